"""`vgpu run --compute`: every process of the command draws from one budget, as a slice should."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.compute_workload import Workload, parse

pytestmark = pytest.mark.slow


def test_processes_of_one_vgpu_run_share_its_compute_cap(workload: Workload) -> None:
    # Only a compute cap, no --region and no memory limit: the command's processes must still
    # form one slice (an anonymous region), not one budget each.
    one = f"{workload.exe} --warmup 0.5 --seconds 2"
    env = {**workload.base_env, "VGPU_NODE_STATE_DIR": str(workload.tmp / "node")}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharing.cli",
            "run",
            "--sim",
            "--compute",
            "30",
            "--",
            "sh",
            "-c",
            f"{one} > {workload.tmp}/a.out & {one} > {workload.tmp}/b.out; wait",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    shares = [parse((workload.tmp / f).read_text(), "", 0).share for f in ("a.out", "b.out")]
    assert 15 < sum(shares) < 40, shares

"""`vgpu selftest --sim`: the conformance run passes on the simulated GPU with every check, and a
shim broken on purpose fails it with the right check named."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sharing.cli.selftest.compute import CAPS, PAIR
from sharing.cli.selftest.memory import ROUTES
from tests.sharing.cli.selftest.conftest import run_selftest

pytestmark = pytest.mark.slow


def test_quick_selftest_passes_on_the_simulated_gpu(selftest_env: dict[str, str]) -> None:
    r = run_selftest("--quick", env=selftest_env)
    assert r.returncode == 0, (r.report["failed"], r.stderr)
    assert r.report["ok"] is True and r.report["failed"] == []
    names = {c["name"] for c in r.report["checks"]}
    expected = {
        "environment.nvml", "environment.shim_driver_api", "environment.shim_cudart",
        *(f"memory.{route}" for route in ROUTES),
        *(f"compute.cap_{cap}" for cap in CAPS),
        *(f"compute.pair_{PAIR[0]}_{PAIR[1]}.{cap}" for cap in PAIR),
        "cost.startup", "cost.calls",
    }  # fmt: skip
    assert expected <= names, expected - names
    # every check ran here: the simulator has a driver, NVML, libcudart (the test extras) and
    # the host's PID namespace
    for c in r.report["checks"]:
        # a share below its cap while the machine kept the probe off its CPUs is not judged
        # (compute._judge); anything else must have been checked and held
        inconclusive = c["name"].startswith("compute.") and c["detail"].startswith("inconclusive")
        assert c["status"] in ("pass", "info") or (c["status"] == "skip" and inconclusive), c
    env = r.report["environment"]
    assert env["gpu"] and env["sms"] and env["glibc"].startswith("glibc")
    for route in ROUTES:  # the driver's view was read for every route and held the quota
        (c,) = [c for c in r.report["checks"] if c["name"] == f"memory.{route}"]
        n = c["numbers"]
        assert n["driver_used"] is not None and n["driver_used"] <= n["quota"], c
        assert n["last_result"] == "CUDA_ERROR_OUT_OF_MEMORY", c
    assert "issue tracker" in r.report["send_to"]


def test_a_missing_memory_hook_fails_its_route(
    selftest_env: dict[str, str], broken_shim: Callable[[tuple[str, ...]], Path]
) -> None:
    shim = broken_shim(("cuMemAllocPitch_v2",))
    r = run_selftest("--quick", "--only", "memory", "--shim", str(shim), env=selftest_env)
    assert r.returncode == 1, r.stderr
    assert r.report["failed"] == ["memory.pitch"], r.report["failed"]
    (c,) = [c for c in r.report["checks"] if c["name"] == "memory.pitch"]
    assert c["numbers"]["driver_used"] > c["numbers"]["quota"], c


def test_an_ignored_cap_fails_the_compute_checks(
    selftest_env: dict[str, str], broken_shim: Callable[[tuple[str, ...]], Path]
) -> None:
    # the launch the probe makes reaches the driver ungated: no cap is enforced
    shim = broken_shim(("cuLaunchKernel",))
    r = run_selftest("--quick", "--only", "compute", "--shim", str(shim), env=selftest_env)
    assert r.returncode == 1, r.stderr
    assert {f"compute.cap_{cap}" for cap in CAPS} <= set(r.report["failed"]), r.report["failed"]
    assert all(name.startswith("compute.") for name in r.report["failed"]), r.report["failed"]


def test_bad_arguments_are_one_line_errors(selftest_env: dict[str, str], tmp_path: Path) -> None:
    for args, needle in (
        (["--only", "memory,gpu"], "allowed sections are environment, memory, compute, cost"),
        (["--shim", str(tmp_path / "none.so")], "no such file"),
        (["--device", "-1"], "must be 0 or more"),
    ):
        p = subprocess.run([sys.executable, "-m", "sharing.cli", "selftest", "--sim", *args],
                           capture_output=True, text=True, timeout=60, env=selftest_env)  # fmt: skip
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, p.stderr)


def test_the_text_report_ends_with_the_verdict_and_where_to_send_it(
    selftest_env: dict[str, str],
) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "sharing.cli", "selftest", "--sim", "--only", "environment"],
        capture_output=True, text=True, timeout=120, env=selftest_env,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[-2] == "VERDICT: PASS (every check held)", p.stdout
    assert lines[-1].startswith("Please send this report to the vgpu-sharing issue tracker"), (
        p.stdout
    )
    assert any(ln.split()[:2] == ["PASS", "environment.shim_driver_api"] for ln in lines), p.stdout
    assert not any("memory." in ln or "compute." in ln for ln in lines), p.stdout

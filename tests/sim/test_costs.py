"""Hot paths stay cheap with many processes on the node: launches and allocations that fit make
no system call per process slot (strace counts them; skipped where strace is missing)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.sim.simhelp import Client

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed"),
]


def _syscalls(
    sim_tool: Path, env: dict[str, str], tmp_path: Path, *args: str
) -> tuple[dict[str, int], str]:
    out = tmp_path / "strace.txt"
    r = subprocess.run(
        ["strace", "-f", "-c", "-o", str(out), str(sim_tool), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    counts = {}
    for line in out.read_text().splitlines():
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$", line)
        if m:
            counts[m.group(2)] = int(m.group(1))
    return counts, r.stdout


def test_hot_paths_make_no_per_slot_syscalls(
    sim_tool: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    others = [Client(sim_tool, sim_env, "hold", str(1 << 20)) for _ in range(4)]  # live slots
    try:
        base, _ = _syscalls(sim_tool, sim_env, tmp_path, "launches", "10")
        many, out = _syscalls(sim_tool, sim_env, tmp_path, "launches", "200000")
        print(out.strip(), {k: many.get(k, 0) for k in ("fcntl", "futex", "clock_nanosleep")})
        # 200000 more launches add no liveness checks and (sim_0us: nothing to wait for) no sleeps;
        # the few fcntl calls are the slot claim at the first context (one per slot on the node)
        assert many.get("fcntl", 0) <= base.get("fcntl", 0) + 2
        assert sum(many.values()) - sum(base.values()) < 50
        base, _ = _syscalls(sim_tool, sim_env, tmp_path, "allocs", "10")
        many, _ = _syscalls(sim_tool, sim_env, tmp_path, "allocs", "5000")
        assert many.get("fcntl", 0) <= base.get("fcntl", 0) + 2  # allocations that fit: no reaping
    finally:
        for c in others:
            c.finish()

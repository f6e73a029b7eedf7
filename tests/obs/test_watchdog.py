"""The watchdog catches processes the shim cannot see: a real program that loads a renamed copy
of the driver (a second driver instance the preloaded shim never hooked) and a GPU process of
no slice, attributed from outside (/proc/<pid>/environ + /proc/<pid>/root)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from sharing.paths import shim_library
from tests.obs.helpers import ExporterProcess, MiB, only, region_with_limits, scrape
from tests.shim.conftest import Held


def start_bypass(program: Path, env: dict[str, str], nbytes: int) -> subprocess.Popen[str]:
    """tests/c/bypass_copy.c holding nbytes; returns once it holds them."""
    p = subprocess.Popen([str(program), str(nbytes)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "held rc=0", (line, p.stderr.read() if p.stderr else "")
    return p


def _violations(url: str, claim: str) -> float:
    got = only(scrape(url), "vgpu_slice_quota_violations_total", claim=claim)
    return got[0].value if got else 0.0


def _wait(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


def test_a_process_bypassing_the_shim_is_caught_and_stopped(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path]
) -> None:
    ops = build_c("shim_ops.c")
    acct = tmp_path / "slice.region"
    region_with_limits(acct, 256 * MiB)
    exp = ExporterProcess(
        ["--sim", "--data-dir", str(tmp_path / "none"), "--region", str(acct),
         "--enforce", "kill", "--watchdog-margin", "16Mi"],
        sim_env,
    )  # fmt: skip
    try:
        # within its quota, through the shim: no violation
        inside = dict(sim_env, LD_PRELOAD=str(shim_library()),
                      CUDA_DEVICE_MEMORY_SHARED_CACHE=str(acct))  # fmt: skip
        ok = Held(ops, inside, "init", "ctx", f"alloc:{200 * MiB}")
        time.sleep(2.5)  # two NVML passes
        assert _violations(exp.url, str(acct)) == 0
        ok.release()
        # the slice's environment and the shim preloaded, but a renamed copy of the driver loaded,
        # out of the shim's reach: the driver grants all 512 MiB
        bypass = start_bypass(build_c("bypass_copy.c"), inside, 512 * MiB)
        assert _wait(lambda: _violations(exp.url, str(acct)) == 1)
        # --enforce kill: SIGTERM (the program does not catch it)
        assert bypass.wait(20) == -signal.SIGTERM
        time.sleep(2.5)
        assert _violations(exp.url, str(acct)) == 1  # one episode, counted once
    finally:
        log = exp.stop()
    lines = [line for line in log.splitlines() if "quota violation" in line]
    assert len(lines) == 1, log
    assert f"pid {bypass.pid}" in lines[0] and "over its quota" in lines[0]
    assert f"stopping pids [{bypass.pid}]" in log


def test_a_gpu_process_of_no_slice_on_a_shared_gpu(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path]
) -> None:
    ops = build_c("shim_ops.c")
    acct = tmp_path / "slice.region"
    region_with_limits(acct, 1 << 30)
    exp = ExporterProcess(
        ["--sim", "--data-dir", str(tmp_path / "none"), "--region", str(acct)], sim_env
    )
    try:
        stray = Held(ops, sim_env, "init", "ctx", f"alloc:{64 * MiB}")
        try:
            assert _wait(lambda: _violations(exp.url, "") == 1)
            assert stray.proc.poll() is None  # enforce none: counted and logged, not stopped
            assert _violations(exp.url, str(acct)) == 0
        finally:
            stray.release()
    finally:
        log = exp.stop()
    assert f"pid {stray.proc.pid}" in log and "belongs to no slice" in log, log

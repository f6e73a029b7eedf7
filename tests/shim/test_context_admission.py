"""A context is admitted against the slice's quota before the driver creates it: with many
processes (and threads in each) starting at once in a fresh slice, the driver's own figure of the
device's used memory, sampled continuously from outside the slice (the simulator's NVML, read by
a process without the shim), never exceeds the quota, not even for a moment.

The simulator takes a context's memory at the start of its creation and, with
SIMGPU_CONTEXT_CREATE_MS, returns only that much later (docs/simulator.md): the window in which
a context exists before the shim can measure it is as wide as on a real GPU, so a context
created before it was admitted is seen by the sampler every time, not by luck."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from sharing import region
from tests.shim.test_memory_paths import slice_env
from tests.sim.simhelp import CONTEXT_MEMORY

pytestmark = pytest.mark.slow

MiB = 1 << 20
QUOTA = 1 << 30  # 1 GiB: two 500 MiB contexts fit, a third does not

# Reads NVML's used memory of device 0 as fast as it can until stdin closes; prints the largest
# reading, how many were taken and the longest gap between two.
# Reads NVML's used memory of device 0 as fast as it can until stdin closes; prints the largest
# reading, how many were over argv[1], how many were taken, the longest gap between two, and the
# first reading taken after a "mark" line arrived on stdin.
SAMPLER = textwrap.dedent("""
    import json, sys, threading, time
    import pynvml as nv
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    stop, mark = threading.Event(), threading.Event()
    def read_stdin():
        for line in sys.stdin:
            mark.set()
        stop.set()
    threading.Thread(target=read_stdin, daemon=True).start()
    peak, over, n, gap, at_mark = 0, 0, 0, 0, None
    last = time.monotonic_ns()
    print("sampling", flush=True)
    while not stop.is_set():
        marked = mark.is_set()
        used = nv.nvmlDeviceGetMemoryInfo(h).used
        now = time.monotonic_ns()
        gap, last, n = max(gap, now - last), now, n + 1
        peak = max(peak, used)
        over += used > int(sys.argv[1])
        if marked and at_mark is None:
            at_mark = used
            print("marked", flush=True)
    print(json.dumps({"peak": peak, "over": over, "samples": n, "max_gap_us": gap // 1000,
                      "at_mark": at_mark}))
""")


class Sampler:
    """The driver's figure, from outside the slice (no shim, its own NVML handle)."""

    def __init__(self, env: dict[str, str], quota: int) -> None:
        plain = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SAMPLER, str(quota)], env=plain, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "sampling", self.proc.stderr

    def mark(self) -> None:
        """Its next reading is reported as at_mark; returns once it is taken."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("mark\n")
        self.proc.stdin.flush()
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "marked"

    def stop(self) -> dict[str, int]:
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err
        result: dict[str, int] = json.loads(out.strip().splitlines()[-1])
        return result


@pytest.fixture
def ctx_storm(build_c: Callable[..., Path]) -> Path:
    return build_c("ctx_storm.c")


class Storm:
    """procs processes of `threads` threads each creating contexts at once; holds them (and
    what they made) until release()."""

    def __init__(
        self, prog: Path, env: dict[str, str], procs: int, threads: int, mode: str
    ) -> None:
        self.procs = [
            subprocess.Popen(
                [str(prog), str(threads), mode],
                env=env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for _ in range(procs)
        ]
        self.codes: list[int] = []  # every thread's CUresult
        self.errs: list[str] = []  # every process's stderr, once released

    def wait(self) -> None:
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.startswith("rc="), (line, p.stderr.read() if p.stderr else "")
            self.codes += [int(c) for c in line[3:].strip().split(",")]
            assert p.stdout.readline().strip() == "ready"

    def release(self) -> None:
        for p in self.procs:
            err = p.communicate(timeout=120)[1]
            self.errs.append(err)
            assert p.returncode == 0, err


@pytest.mark.parametrize(
    ("create_ms", "mode"),
    [
        # creation slower than any bounded wait for the measuring process: on a real GPU the
        # first context after the driver brings the GPU up takes seconds
        ("2500", "mixed"),
        ("300", "primary"),  # tens to hundreds of ms: a context's creation on a real GPU
        ("0", "create"),  # instantaneous creation: only the shim's own ordering is in play
    ],
)
def test_many_processes_and_threads_at_once_never_exceed_the_quota(
    create_ms: str, mode: str, ctx_storm: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """4 processes x 8 threads create 500 MiB contexts at once in a fresh 1 GiB slice (whose
    accounting file does not exist yet): two contexts are made, every other creation is refused
    before the driver is asked, and the device's used memory never passes the quota."""
    env, reg = slice_env(shim_env, tmp_path, str(QUOTA))
    env["SIMGPU_CONTEXT_CREATE_MS"] = create_ms
    sampler = Sampler(env, QUOTA)
    try:
        storm = Storm(ctx_storm, env, 4, 8, mode)
        try:
            storm.wait()
            used = region.read(reg).devices[0].used
            sampler.mark()  # read once more while they hold their contexts
        finally:
            storm.release()
    finally:
        seen = sampler.stop()
    codes = storm.codes
    assert seen["samples"] > 100, seen  # it did look, many times
    assert seen["peak"] <= QUOTA and seen["over"] == 0, seen
    # a primary context is one per process: its later retains share it
    made = 2 * CONTEXT_MEMORY
    assert used == made, (used, codes)
    assert set(codes) <= {0, 2}, codes  # success or CUDA_ERROR_OUT_OF_MEMORY, nothing else
    assert seen["at_mark"] == made, seen  # the two contexts, seen by the sampler too

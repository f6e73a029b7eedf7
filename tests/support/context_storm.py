"""Many processes creating CUDA contexts at once in one slice (tests/c/ctx_storm.c), and a sampler
of the driver's used-memory figure from outside the slice (NVML without the shim) that records
its peak while they do."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

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

"""Programs nobody here wrote, installed from PyPI into .venv/frameworks by scripts/setup, run
unmodified under `vgpu run --sim --memory`: a two-line launcher prints what the framework sees
of the device, runs the program's module as `python -m` would, and then holds the process (and
whatever the framework's allocator still reserves) until told to go, so that the driver's view
from outside the slice is read at a known point; a sampler reads it throughout the run."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass

from tests.support.context_storm import Sampler
from tests.support.shim_memory import nvml_procs

# argv: the framework's module, the program's module, the program's arguments. The program runs
# in this process after the launcher has read the device through the framework's own call.
LAUNCHER = textwrap.dedent("""
    import runpy, sys
    framework, program, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if framework == "torch":
        import torch
        free, total = torch.cuda.mem_get_info()
    else:
        import cupy
        free, total = cupy.cuda.runtime.memGetInfo()
    print(f"seen free={free} total={total}", flush=True)
    sys.argv = [program, *args]
    try:
        runpy.run_module(program, run_name="__main__", alter_sys=True)
    finally:
        print("holding", flush=True)
        sys.stdin.readline()
""")


@dataclass
class ForeignRun:
    out: str  # the program's standard output
    err: str
    rc: int
    free: int  # what the framework's memory query showed before the program ran
    total: int
    held: dict[int, int]  # NVML's used memory per process, read from outside while it held
    sampled: dict[str, int]  # the sampler's figures (tests/support/context_storm.py) over the run


def run_foreign(
    env: dict[str, str], python: str, framework: str, program: str, *args: str, quota: int
) -> ForeignRun:
    """Run `python -m program args` (with `framework` imported first) under
    `vgpu run --sim --memory quota`, sampling the driver's used memory from outside the slice."""
    cmd = [sys.executable, "-m", "sharing.cli", "run", "--sim", "--memory", str(quota), "--"]
    cmd += [python, "-c", LAUNCHER, framework, program, *args]
    sampler = Sampler(env, quota)
    held: dict[int, int] = {}
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(
            cmd, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err
        )
        try:
            assert p.stdout is not None and p.stdin is not None
            lines = []
            for line in p.stdout:
                if line.strip() == "holding":
                    held = nvml_procs(env)
                    p.stdin.write("go\n")
                    p.stdin.flush()
                    break
                lines.append(line)
            lines += p.stdout.readlines()
            rc = p.wait(timeout=240)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        err.seek(0)
        stderr = err.read()
    sampled = sampler.stop()
    out = "".join(lines)
    m = re.search(r"^seen free=(\d+) total=(\d+)$", out, re.M)
    assert m, out + stderr[-4000:]
    return ForeignRun(out, stderr, rc, int(m.group(1)), int(m.group(2)), held, sampled)

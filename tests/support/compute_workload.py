"""The compute-cap workload (tests/c/compute_workload.c) run on the simulated GPU under the
shim, its result line, and the compute state it leaves in the accounting file."""

from __future__ import annotations

import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sharing._region_cffi import ffi

from sharing.observe.cpuwait import starved
from sharing.paths import shim_library


def compute_state(region: Path, dev: int = 0) -> Any:
    """A copy of device `dev`'s compute state in the accounting file `region`.

    A copy: a cast of ffi.from_buffer() points into the bytes read, which do not outlive this
    function."""
    data = region.read_bytes()
    r = ffi.cast("struct vgpu_region *", ffi.from_buffer(data))
    st = ffi.new("struct vgpu_compute_state *")
    ffi.memmove(st, r.compute + dev, ffi.sizeof("struct vgpu_compute_state"))
    return st


def demand_file(path: Path) -> Any:
    """A copy of a demand file (struct vgpu_demand_file)."""
    data = path.read_bytes()
    f = ffi.new("struct vgpu_demand_file *")
    ffi.memmove(f, data, min(len(data), ffi.sizeof("struct vgpu_demand_file")))
    return f


@dataclass
class Result:
    share: float
    launches: int
    window_s: float
    cpu_s: float
    total_s: float
    start_ns: int
    busy_run_ns: int  # device time the simulator served the process over the whole run
    launches_run: int
    cpu_wait_s: float  # the launching threads' time runnable but waiting for a CPU, summed
    timeline: list[tuple[int, float]]
    stdout: str
    stderr: str
    returncode: int


def host_starved(r: Result) -> bool:
    """The host kept r's launching threads waiting for a CPU (sharing.observe.cpuwait.starved): a process
    that is not running launches nothing, so a share short of its cap then says nothing about the
    cap (a share above it still does)."""
    return starved(r.cpu_wait_s, r.total_s)


def at_least(r: Result, lo: float) -> bool:
    """r got more than lo percent of the device, or the host starved it (then said as a warning)."""
    if r.share > lo:
        return True
    if host_starved(r):
        warnings.warn(
            f"share {r.share:.1f}% <= {lo}% while waiting {r.cpu_wait_s:.2f} s of {r.total_s:.2f} s"
            " for a CPU: the lower bound is not judged on a starved host",
            stacklevel=2,
        )
        return True
    return False


def parse(out: str, err: str, rc: int) -> Result:
    kv: dict[str, str] = {}
    tl: list[tuple[int, float]] = []
    for line in out.splitlines():
        if line.startswith("tl "):
            _, t, s = line.split()
            tl.append((int(t), float(s)))
            continue
        for tok in line.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                kv[k] = v
    return Result(
        share=float(kv.get("share", "nan")),
        launches=int(kv.get("launches", "0")),
        window_s=float(kv.get("window_s", "0")),
        cpu_s=float(kv.get("cpu_s", "0")),
        total_s=float(kv.get("total_s", "0")),
        start_ns=int(kv.get("start_ns", "0")),
        busy_run_ns=int(kv.get("busy_run_ns", "0")),
        launches_run=int(kv.get("launches_run", "0")),
        cpu_wait_s=float(kv.get("cpu_wait_s", "0")),
        timeline=tl,
        stdout=out,
        stderr=err,
        returncode=rc,
    )


class Workload:
    """Starts compute_workload processes (tests/c/compute_workload.c) under the shim."""

    def __init__(self, exe: Path, base_env: dict[str, str], tmp: Path) -> None:
        self.exe = exe
        self.base_env = base_env
        self.tmp = tmp
        (tmp / "node").mkdir(exist_ok=True)

    def env(self, slice_name: str = "a", shim: bool = True, **extra: str) -> dict[str, str]:
        env = dict(self.base_env)
        for k in list(env):
            if k.startswith(
                (
                    "CUDA_DEVICE_SM_LIMIT",
                    "VGPU_",
                    "GPU_CORE_UTILIZATION_POLICY",
                    "CUDA_TASK_PRIORITY",
                )
            ):
                del env[k]
        if shim:
            env["LD_PRELOAD"] = str(shim_library())
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(self.tmp / f"slice-{slice_name}.region")
        env["VGPU_NODE_STATE_DIR"] = str(self.tmp / "node")
        env.update(extra)
        return env

    def start(self, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(self.exe), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    @staticmethod
    def wait(p: subprocess.Popen[str], timeout: float = 120) -> Result:
        out, err = p.communicate(timeout=timeout)
        return parse(out, err, p.returncode)

    def run(self, env: dict[str, str], *args: str, timeout: float = 120) -> Result:
        return self.wait(self.start(env, *args), timeout)

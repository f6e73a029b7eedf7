"""`vgpu demo`: two tenants share one simulated GPU under hard memory and compute limits.

Everything is real except the GPU: each tenant is a separate process started through `vgpu run`
(libvgpu.so preloaded, limits set) running an ordinary CUDA client (sharing/demo_workload.py) on
the simulated driver. The memory results are what the processes see (cuMemGetInfo, refused
allocations); the compute shares are each tenant's completed kernels (1 ms of device time each in
the simulator's kernel model) over its wall time; the live line is the device's NVML utilisation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from sharing.gpus import use_simulator
from sharing.quantity import format_bytes, parse_bytes

KERNEL_US = 1000  # sim_1000us: one wave of the kernel is 1 ms of device time


# How far a measured compute share may exceed its cap before the demo calls it a failure.
CAP_TOLERANCE_POINTS = 3.0


class DemoError(RuntimeError):
    pass


@dataclass
class Tenant:
    name: str
    memory: int
    compute: int
    proc: subprocess.Popen[str] | None = None
    events: dict[str, dict[str, Any]] = field(default_factory=dict)
    stderr: str = ""


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="two tenants share one simulated GPU under hard limits")
    p.add_argument("--seconds", type=float, default=6.0, help="length of the compute phase")
    p.set_defaults(func=run)


def _start(tenant: Tenant, workdir: Path, workload: list[str]) -> None:
    """Start one tenant's workload exactly as a user would: through `vgpu run`."""
    cmd = [
        sys.executable, "-m", "sharing.cli", "run", "--sim",
        "--memory", str(tenant.memory), "--compute", str(tenant.compute),
        "--region", str(workdir / f"{tenant.name}.region"),
        "--", sys.executable, "-m", "sharing.demo_workload", *workload,
    ]  # fmt: skip
    tenant.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collect(tenant: Tenant) -> None:
    assert tenant.proc is not None
    out, tenant.stderr = tenant.proc.communicate()
    tenant.events.clear()
    for line in out.splitlines():
        ev = json.loads(line)
        tenant.events[ev["event"]] = ev
    if tenant.proc.returncode != 0:
        err = tenant.events.get("error", {}).get("message", f"exit {tenant.proc.returncode}")
        raise DemoError(f"tenant {tenant.name} failed: {err}; its stderr: {tenant.stderr.strip()}")


def run(args: argparse.Namespace) -> int:
    tenants = [
        Tenant("team-a", parse_bytes("4Gi"), 30),
        Tenant("team-b", parse_bytes("8Gi"), 60),
    ]
    with tempfile.TemporaryDirectory(prefix="vgpu-demo-") as tmp:
        workdir = Path(tmp)
        sim_state = workdir / "simgpu"
        sim_state.mkdir()
        try:
            return _demo(tenants, workdir, sim_state, args.seconds)
        except DemoError as e:
            print(f"vgpu demo: {e}", file=sys.stderr)
            return 1


def _demo(tenants: list[Tenant], workdir: Path, sim_state: Path, seconds: float) -> int:
    # The tenants (our children) and this process see one simulated node.
    os.environ["SIMGPU_STATE"] = str(sim_state)
    use_simulator()
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    name = pynvml.nvmlDeviceGetName(h)
    total = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
    print(f"vgpu demo: {len(tenants)} tenants share one simulated {name} ({format_bytes(total)})\n")
    print(f"  {'tenant':<8} {'memory quota':<13} compute cap")
    for t in tenants:
        print(f"  {t.name:<8} {format_bytes(t.memory):<13} {t.compute}%")

    failures: list[str] = []
    print("\n[1/2] Memory: each tenant allocates 1 GiB chunks until it is refused")
    for t in tenants:
        _start(t, workdir, ["--seconds", "0"])
    for t in tenants:
        _collect(t)
        seen = t.events["meminfo"]["total"]
        got = t.events["alloc"]["granted"]
        denied = t.events["alloc"]["denied"]
        refused = "the next was refused" if denied else "none was refused"
        print(f"  {t.name} sees a {format_bytes(seen)} GPU; got {got} x 1 GiB, {refused}")
        for line in t.stderr.splitlines():
            print(f"    {t.name} stderr: {line}")
        if seen != t.memory or got * (1 << 30) > t.memory or not denied:
            failures.append(
                f"{t.name}: saw {format_bytes(seen)} and got {got} GiB, quota {format_bytes(t.memory)}"
            )

    print(f"\n[2/2] Compute: both launch 1 ms kernels back to back for {seconds:.0f} s")
    for t in tenants:
        _start(t, workdir, ["--max-chunks", "0", "--seconds", str(seconds)])
    start = time.monotonic()
    while any(t.proc is not None and t.proc.poll() is None for t in tenants):
        time.sleep(1.0)
        elapsed = time.monotonic() - start
        if elapsed <= seconds + 0.5:
            busy = int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            print(f"  t={elapsed:4.1f}s  device busy {busy:3d}%", flush=True)
    for t in tenants:
        _collect(t)
    print(f"\n  {'tenant':<8} {'cap':>4} {'measured':>9}")
    for t in tenants:
        done = t.events["done"]
        # Device time the tenant's completed kernels took, over its wall time.
        share = 100.0 * done["launches"] * KERNEL_US / 1e6 / done["seconds"]
        print(f"  {t.name:<8} {t.compute:>3}% {share:>8.1f}%")
        if share > t.compute + CAP_TOLERANCE_POINTS:
            failures.append(f"{t.name}: used {share:.1f}% with a {t.compute}% cap")
    pynvml.nvmlShutdown()
    if failures:
        print("\nLIMITS NOT HELD: " + "; ".join(failures))
        return 1
    print("\nEach tenant saw only its own slice and stayed within its caps.")
    return 0

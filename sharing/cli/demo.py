"""`vgpu demo`: two tenants share one simulated GPU under hard memory and compute limits.

Everything is real except the GPU: each tenant is a separate process started through `vgpu run`
(libvgpu.so preloaded, limits set) running an ordinary CUDA client (sharing/cli/demo_workload.py) on
the simulated driver. The memory results are what the processes see (cuMemGetInfo, refused
allocations); the compute shares are each tenant's completed kernels (1 ms of device time on
average in the simulator's kernel model, which varies each run by 20%) over its wall time in the
steady state (the last three quarters of the phase: the first holds the cap's burst and its
learning of the kernel's cost), checked from both sides: above its cap is a failure, and so is far
below it (a tenant starved, or no compute phase at all). While it runs the demo serves the exporter
(its URL is printed) and shows the live `vgpu top` view.
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
from rich.console import Console
from rich.live import Live

from sharing import region
from sharing.cli.top import render
from sharing.counters import read_counters
from sharing.gpus import use_simulator
from sharing.observe.cpuwait import starved
from sharing.observe.exporter import (
    DEFAULT_PORT,
    Exporter,
    ExporterConfig,
    ListenError,
    parse_listen,
)
from sharing.quantity import format_bytes, parse_bytes

KERNEL_US = 1000  # sim_1000us: one wave of the kernel is 1 ms of device time


# How far a measured compute share may exceed its cap before the demo calls it a failure.
CAP_TOLERANCE_POINTS = 3.0
# How far below its cap a tenant that launched back to back for the whole phase may fall:
# max(points, fraction of the cap). Below that it did not get its share.
SHARE_SHORTFALL_POINTS = 5.0
SHARE_SHORTFALL_FRACTION = 0.25


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
    achieved: float = 0.0  # percent, from its completed kernels
    charged: float = 0.0  # percent, device time the compute gate charged (the exporter's view)
    memory_seen: int = 0  # the GPU's total memory as the tenant saw it
    context: int = 0  # what its CUDA context takes of the quota (used before it allocated)
    granted: int = 0  # 1 GiB chunks it got
    refused: bool = False  # the next one was refused
    cpu_wait: float = 0.0  # percent of its compute phase it spent runnable, waiting for a CPU
    inconclusive: bool = False  # short of its share while the host kept it waiting

    def region(self, workdir: Path) -> Path:
        return workdir / f"{self.name}.region"


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="two tenants share one simulated GPU under hard limits")
    p.add_argument("--seconds", type=float, default=6.0, help="length of the compute phase")
    p.add_argument("--json", action="store_true", help="print only a JSON summary")
    p.add_argument(
        "--listen",
        default=f"127.0.0.1:{DEFAULT_PORT}",
        metavar="HOST:PORT",
        help=f"where to serve the exporter while the demo runs (default 127.0.0.1:{DEFAULT_PORT}; "
        "another free port if that one is taken)",
    )
    p.set_defaults(func=run)


def _start(tenant: Tenant, workdir: Path, workload: list[str]) -> None:
    """Start one tenant's workload exactly as a user would: through `vgpu run`."""
    cmd = [
        sys.executable, "-m", "sharing.cli", "run", "--sim",
        "--memory", str(tenant.memory), "--compute", str(tenant.compute),
        "--region", str(tenant.region(workdir)),
        "--", sys.executable, "-m", "sharing.cli.demo_workload", *workload,
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
    if args.seconds < 0:
        print(f"vgpu demo: --seconds {args.seconds:g}: must be 0 or more", file=sys.stderr)
        return 2
    try:
        listen = parse_listen(args.listen)
    except ListenError as e:
        print(f"vgpu demo: --listen {e}", file=sys.stderr)
        return 2
    tenants = [
        Tenant("team-a", parse_bytes("4Gi"), 30),
        Tenant("team-b", parse_bytes("8Gi"), 60),
    ]
    with tempfile.TemporaryDirectory(prefix="vgpu-demo-") as tmp:
        workdir = Path(tmp)
        sim_state = workdir / "simgpu"
        sim_state.mkdir()
        try:
            return _demo(tenants, workdir, sim_state, args.seconds, listen, args.json)
        except DemoError as e:
            print(f"vgpu demo: {e}", file=sys.stderr)
            return 1


def _serve(tenants: list[Tenant], workdir: Path, listen: tuple[str, int]) -> tuple[Exporter, str]:
    """The exporter over the tenants' accounting files; another port if the asked one is taken."""
    for t in tenants:  # `vgpu run --region` writes each one's limits beside it (FILE.limits)
        region.create(t.region(workdir))
    config = ExporterConfig(
        data_dir=None, regions=tuple(str(t.region(workdir)) for t in tenants), hostname="vgpu-demo"
    )
    exporter = Exporter(config)
    try:
        host, port = exporter.start(*listen)
    except OSError:
        exporter = Exporter(config)
        host, port = exporter.start(listen[0], 0)
    return exporter, f"http://{host}:{port}/metrics"


def _demo(
    tenants: list[Tenant],
    workdir: Path,
    sim_state: Path,
    seconds: float,
    listen: tuple[str, int],
    as_json: bool,
) -> int:
    # The tenants (our children) and this process see one simulated node.
    os.environ["SIMGPU_STATE"] = str(sim_state)
    use_simulator()
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    name = pynvml.nvmlDeviceGetName(h)
    total = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
    pynvml.nvmlShutdown()
    exporter, url = _serve(tenants, workdir, listen)
    say = (lambda *a, **k: None) if as_json else print
    try:
        say(f"vgpu demo: {len(tenants)} tenants share one simulated {name} ({format_bytes(total)})")
        say(f"metrics: {url} (vgpu exporter, while the demo runs)\n")
        say(f"  {'tenant':<8} {'memory quota':<13} compute cap")
        for t in tenants:
            say(f"  {t.name:<8} {format_bytes(t.memory):<13} {t.compute}%")
        failures = _memory_phase(tenants, workdir, say)
        failures += _compute_phase(tenants, workdir, seconds, exporter, say, as_json)
    finally:
        exporter.stop()
    ok = not failures
    if as_json:
        print(json.dumps(_summary(tenants, name, total, url, seconds, failures), indent=2))
    elif failures:
        print("\nLIMITS NOT HELD: " + "; ".join(failures))
    elif any(t.inconclusive for t in tenants):
        print(
            "\nEach tenant saw only its own slice and stayed within its caps; whether each got its"
            " share is inconclusive on this busy host."
        )
    else:
        print("\nEach tenant saw only its own slice, stayed within its caps and got its share.")
    return 0 if ok else 1


def _memory_phase(tenants: list[Tenant], workdir: Path, say: Any) -> list[str]:
    failures: list[str] = []
    say("\n[1/2] Memory: each tenant allocates 1 GiB chunks until it is refused")
    for t in tenants:
        _start(t, workdir, ["--seconds", "0"])
    for t in tenants:
        _collect(t)
        seen = t.events["meminfo"]["total"]
        got = t.events["alloc"]["granted"]
        denied = t.events["alloc"]["denied"]
        t.memory_seen, t.granted, t.refused = seen, got, bool(denied)
        t.context = seen - t.events["meminfo"]["free"]
        refused = "the next was refused" if denied else "none was refused"
        say(
            f"  {t.name} sees a {format_bytes(seen)} GPU, {format_bytes(t.context)} of it its CUDA"
            f" context's; got {got} x 1 GiB, {refused}"
        )
        for line in t.stderr.splitlines():
            say(f"    {t.name} stderr: {line}")
        if seen != t.memory or t.context + got * (1 << 30) > t.memory or not denied:
            failures.append(
                f"{t.name}: saw {format_bytes(seen)} and got {got} GiB, quota {format_bytes(t.memory)}"
            )
    return failures


def _charged_ns(t: Tenant, workdir: Path) -> int:
    return read_counters(str(t.region(workdir)), 1).devices[0].charged_ns


def _compute_phase(
    tenants: list[Tenant],
    workdir: Path,
    seconds: float,
    exporter: Exporter,
    say: Any,
    as_json: bool,
) -> list[str]:
    say(f"\n[2/2] Compute: both launch 1 ms kernels back to back for {seconds:g} s")
    before = {t.name: _charged_ns(t, workdir) for t in tenants}
    for t in tenants:
        _start(t, workdir, ["--max-chunks", "0", "--seconds", str(seconds)])

    def running() -> bool:
        return any(t.proc is not None and t.proc.poll() is None for t in tenants)

    if as_json:
        while running():
            time.sleep(0.2)
    else:
        console = Console()
        with Live(render(exporter.view.build()), console=console, auto_refresh=False) as live:
            while running():
                time.sleep(1.0)
                view = exporter.view.build()
                # A frame is drawn only when the tenants ran through all of its window: one
                # they left during it would show less than they got (the summary says that).
                if running():
                    live.update(render(view), refresh=True)
    for t in tenants:
        _collect(t)
    failures: list[str] = []
    say(
        "\n  achieved: device time of its kernels in the steady state (the last three quarters);"
        "\n  charged: device time the cap charged it over the whole phase"
    )
    say(f"\n  {'tenant':<8} {'cap':>4} {'achieved':>9} {'charged':>8}")
    for t in tenants:
        done = t.events["done"]
        # Device time the tenant's completed kernels took in the steady state, over its wall
        # time (the whole phase when it was too short to have one).
        steady = done["steady_seconds"] > 0
        launches = done["steady_launches"] if steady else done["launches"]
        seconds = done["steady_seconds"] if steady else done["seconds"]
        waited = done["steady_cpu_wait_seconds"] if steady else done["cpu_wait_seconds"]
        t.achieved = 100.0 * launches * KERNEL_US / 1e6 / seconds if seconds else 0.0
        t.cpu_wait = 100.0 * waited / seconds if seconds else 0.0
        charged_s = (_charged_ns(t, workdir) - before[t.name]) / 1e9
        t.charged = 100.0 * charged_s / done["seconds"] if done["seconds"] else 0.0
        say(f"  {t.name:<8} {t.compute:>3}% {t.achieved:>8.1f}% {t.charged:>7.1f}%")
        low = t.compute - max(SHARE_SHORTFALL_POINTS, SHARE_SHORTFALL_FRACTION * t.compute)
        if t.achieved > t.compute + CAP_TOLERANCE_POINTS:
            failures.append(f"{t.name}: used {t.achieved:.1f}% with a {t.compute}% cap")
        elif t.achieved < low and starved(waited, seconds):
            # Runnable but not running: the host, not the cap, took the share it lacked.
            t.inconclusive = True
            say(
                f"  {t.name}: {t.achieved:.1f}% is inconclusive: it waited {t.cpu_wait:.0f}% of its"
                " time for a CPU (a busy host); rerun on an idle machine"
            )
        elif t.achieved < low:
            failures.append(
                f"{t.name}: got only {t.achieved:.1f}% with a {t.compute}% cap (at least "
                f"{low:.1f}% expected)"
            )
    return failures


def _summary(
    tenants: list[Tenant], name: str, total: int, url: str, seconds: float, failures: list[str]
) -> dict[str, Any]:
    return {
        "ok": not failures,
        "failures": failures,
        "metrics_url": url,
        "device": {"name": name, "memory_total_bytes": total},
        "compute_seconds": seconds,
        "tenants": [
            {
                "name": t.name,
                "memory_limit_bytes": t.memory,
                "memory_seen_bytes": t.memory_seen,
                "context_bytes": t.context,
                "granted_gib_chunks": t.granted,
                "next_allocation_refused": t.refused,
                "compute_cap_percent": t.compute,
                "achieved_percent": round(t.achieved, 2),
                "charged_percent": round(t.charged, 2),
                "cpu_wait_percent": round(t.cpu_wait, 2),
                "share_inconclusive": t.inconclusive,
            }
            for t in tenants
        ],
    }

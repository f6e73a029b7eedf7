"""Memory: every allocation route the shim hooks, filled in a slice until the quota refuses.

For each route a probe process in a fresh slice allocates in halving chunks until one unit (a
page; for contexts, one context) is refused, then holds everything while the driver's view is
read. Checks, per route: the program sees its quota as the GPU's memory (cuMemGetInfo, NVML in
the process); the driver never charges the process more than the quota (host NVML, per
process); and the refusal came within one unit of the quota (program and driver view alike)."""

from __future__ import annotations

import logging

from sharing.cli.selftest.nvml_view import NvmlView
from sharing.cli.selftest.probe import ProbeError, Runner, last_line, parse_kv
from sharing.cli.selftest.report import FAIL, PASS, Check, Report
from sharing.quantity import format_bytes

log = logging.getLogger(__name__)

# Every route the shim hooks, as the probe names them (shim/selftest/probe.c).
ROUTES = (
    "plain",
    "pitch",
    "managed",
    "async",
    "pool",
    "vmm",
    "array",
    "graph",
    "global",
    "context",
)
CHUNK = 256 << 20  # the first allocation size; halved after each refusal
THRESHOLD = (
    "the program sees the quota (cuMemGetInfo and NVML); the driver charges at most the quota; "
    "the last unit (a page; a context for contexts) is refused with less than one unit left"
)


def check_routes(
    report: Report, runner: Runner, device: int, quota: int, routes: tuple[str, ...] = ROUTES
) -> None:
    for route in routes:
        try:
            report.add(_route(runner, device, quota, route))
        except ProbeError as e:
            report.add(Check(f"memory.{route}", FAIL, str(e), THRESHOLD))


def _route(runner: Runner, device: int, quota: int, route: str) -> Check:
    env = runner.slice_env(f"mem-{route}", memory=quota)
    chunk = min(CHUNK, quota // 4)
    p = runner.start(env, "fill", str(device), route, str(chunk), str(quota + chunk))
    assert p.stdout is not None and p.stdin is not None
    out: list[str] = []
    driver_used: int | None = None
    try:
        for line in p.stdout:
            out.append(line)
            if line.strip() == "ready":
                kv = parse_kv("".join(out))
                view = NvmlView(device)
                try:
                    driver_used = view.used_by(int(kv["pid"]))
                finally:
                    view.close()
                break
        rest, err = p.communicate("done\n", timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    kv = parse_kv("".join(out) + rest)
    if p.returncode != 0 or "route" not in kv:
        raise ProbeError(f"probe fill {route} exited {p.returncode}: {last_line(err)}")
    return judge(route, quota, kv, driver_used)


def judge(route: str, quota: int, kv: dict[str, str], driver_used: int | None) -> Check:
    total, free = int(kv["total"]), int(kv["free"])
    nvml_total, unit = int(kv["nvml_total"]), int(kv["unit"])
    used = total - free
    problems: list[str] = []
    if total != quota:
        problems.append(f"cuMemGetInfo total {format_bytes(total)}, not the quota")
    if nvml_total and nvml_total != quota:
        problems.append(f"NVML in the process reports {format_bytes(nvml_total)}, not the quota")
    if used > quota:
        problems.append(f"the program used {format_bytes(used)}, above the quota")
    if driver_used is not None and driver_used > quota:
        problems.append(f"the driver charges {format_bytes(driver_used)}, above the quota")
    if kv["last"] != "CUDA_ERROR_OUT_OF_MEMORY":
        problems.append(
            f"the fill ended with {kv['last']}, not a refusal (CUDA_ERROR_OUT_OF_MEMORY)"
        )
    elif free >= unit:
        problems.append(
            f"refused with {format_bytes(free)} left (program view), a unit is {format_bytes(unit)}"
        )
    if (
        driver_used is not None
        and kv["last"] == "CUDA_ERROR_OUT_OF_MEMORY"
        and quota - driver_used >= unit
    ):
        problems.append(f"refused with {format_bytes(quota - driver_used)} left (driver view)")
    driver = "not listed by host NVML" if driver_used is None else format_bytes(driver_used)
    detail = (
        f"program saw {format_bytes(total)}, used {format_bytes(used)}; driver: {driver}; "
        f"{kv['allocs']} allocations, then {kv['last']}"
    )
    if driver_used is None:
        detail += " (the driver's view needs the host's PID namespace: run on the node)"
    if problems:
        detail = "; ".join(problems) + " — " + detail
    numbers = {
        "quota": quota,
        "program_total": total,
        "program_used": used,
        "nvml_in_process_total": nvml_total,
        "driver_used": driver_used,
        "granted": int(kv["granted"]),
        "allocations": int(kv["allocs"]),
        "unit": unit,
        "last_result": kv["last"],
    }
    return Check(f"memory.{route}", FAIL if problems else PASS, detail, THRESHOLD, numbers)

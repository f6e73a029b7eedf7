"""Cost: what the shim adds to a program's start and to each call, against the same program
without the shim, on this node.

Start-up: the shim's own set-up at the first CUDA call, as it reports it (LIBCUDA_LOG_LEVEL=4:
"setup took N ns" wall, "setup cpu N ns" on-CPU), over several process starts; judged on the
on-CPU time against the project's target (BENCHMARKS.md: p50 <= 0.3 ms, p99 <= 2 ms), because
wall time also counts whatever else the node's CPUs were doing. Per call: the probe's thread CPU
time per cuMemGetInfo, cuMemAlloc+cuMemFree and cuLaunchKernel, with the shim (a slice with a
quota) and without; reported, not judged (the project sets no target for them)."""

from __future__ import annotations

import re
import statistics

from sharing.cli.selftest.probe import ProbeError, Runner
from sharing.cli.selftest.report import FAIL, INFO, PASS, Check, Report

P50_MS, P99_MS = 0.3, 2.0
_SETUP = re.compile(r"setup (took|cpu) (\d+) ns")


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def check_startup(report: Report, runner: Runner, device: int, starts: int, quota: int) -> None:
    wall: list[float] = []
    cpu: list[float] = []
    env = runner.slice_env("cost-start", memory=quota,
                           LIBCUDA_LOG_LEVEL="4")  # fmt: skip
    threshold = f"the shim's on-CPU set-up p50 <= {P50_MS} ms, p99 <= {P99_MS} ms"
    for _ in range(starts):
        p = runner.start(env, "env", str(device))
        _, err = p.communicate(timeout=120)
        for kind, ns in _SETUP.findall(err):
            (wall if kind == "took" else cpu).append(int(ns) / 1e6)
    if not cpu:
        report.add(Check("cost.startup", FAIL, "the shim reported no set-up time (did it load?)",
                         threshold))  # fmt: skip
        return
    c50, c99 = _pct(cpu, 0.5), _pct(cpu, 0.99)
    w50, w99 = _pct(wall, 0.5), _pct(wall, 0.99)
    ok = c50 <= P50_MS and c99 <= P99_MS
    report.add(
        Check(
            "cost.startup",
            PASS if ok else FAIL,
            f"shim set-up at the first CUDA call, {len(cpu)} starts: on-CPU p50 {c50:.3f} ms, p99 "
            f"{c99:.3f} ms; wall p50 {w50:.3f} ms, p99 {w99:.3f} ms",
            threshold,
            {"cpu_ms_p50": c50, "cpu_ms_p99": c99, "wall_ms_p50": w50, "wall_ms_p99": w99},
        )
    )


def check_calls(report: Report, runner: Runner, device: int, calls: int, quota: int) -> None:
    base = runner.base_env()
    shim = runner.slice_env("cost-calls", memory=quota)
    try:
        runs = [(runner.run(base, "cost", str(device), str(calls)),
                 runner.run(shim, "cost", str(device), str(calls))) for _ in range(3)]  # fmt: skip
    except ProbeError as e:
        report.add(Check("cost.calls", FAIL, str(e)))
        return
    parts: list[str] = []
    numbers: dict[str, float] = {}
    for key, label in (("meminfo_ns", "cuMemGetInfo"), ("alloc_free_ns", "cuMemAlloc+cuMemFree"),
                       ("launch_ns", "cuLaunchKernel")):  # fmt: skip
        without = statistics.median(float(a[key]) for a, _ in runs)
        with_ = statistics.median(float(b[key]) for _, b in runs)
        numbers[f"{key}_without"] = without
        numbers[f"{key}_with"] = with_
        parts.append(f"{label} {without:.0f} -> {with_:.0f} ns ({with_ - without:+.0f})")
    report.add(Check("cost.calls", INFO, "thread CPU per call, without -> with the shim: "
                     + "; ".join(parts), "measured (no project target)", numbers))  # fmt: skip

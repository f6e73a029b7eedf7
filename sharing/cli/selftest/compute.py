"""Compute: the share of the device a capped slice achieves, measured by the driver.

Each slice runs the probe's spin kernel (PTX that reads the GPU's global timer until the time it
is given has passed, compiled by the driver at load) back to back, one block per SM; the host's
NVML (nvmlDeviceGetProcessUtilization, without the shim) samples the process's share once a
second after a warm-up (the median of the samples). Checks: one slice at each cap alone, then two slices side by side; the
error against the cap within the project's targets (BENCHMARKS.md: a cap alone +-2 points, two
slices +-3 each)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

from sharing.cli.selftest.nvml_view import NvmlView, UtilizationUnavailable
from sharing.cli.selftest.probe import ProbeError, Runner, last_line, parse_kv
from sharing.cli.selftest.report import FAIL, PASS, SKIP, Check, Report
from sharing.observe.cpuwait import cpu_wait_ns, starved

CAPS = (20, 50, 80)
PAIR = (30, 60)
ALONE_POINTS = 2.0
PAIR_POINTS = 3.0
KERNEL_NS = 1_000_000  # each launch spins 1 ms on every SM


@dataclass(frozen=True)
class Timing:
    warmup_s: float
    window_s: float


FULL = Timing(warmup_s=2.0, window_s=8.0)
QUICK = Timing(warmup_s=1.0, window_s=4.0)


def check_caps(report: Report, runner: Runner, device: int, timing: Timing) -> None:
    try:
        _check_caps(report, runner, device, timing)
    except UtilizationUnavailable as e:
        report.add(Check("compute.caps", SKIP, f"skipped: the driver cannot measure a process's "
                         f"share on this GPU ({e})"))  # fmt: skip


def _check_caps(report: Report, runner: Runner, device: int, timing: Timing) -> None:
    for cap in CAPS:
        name = f"compute.cap_{cap}"
        try:
            (share,) = _measure(runner, device, [cap], timing)
        except ProbeError as e:
            report.add(Check(name, FAIL, str(e), f"within +-{ALONE_POINTS:g} points of {cap}%"))
            continue
        report.add(_judge(name, cap, share, ALONE_POINTS, "alone"))
    names = [f"compute.pair_{PAIR[0]}_{PAIR[1]}.{c}" for c in PAIR]
    try:
        shares = _measure(runner, device, list(PAIR), timing)
    except ProbeError as e:
        for n, c in zip(names, PAIR, strict=True):
            report.add(Check(n, FAIL, str(e), f"within +-{PAIR_POINTS:g} points of {c}%"))
        return
    for n, c, s in zip(names, PAIR, shares, strict=True):
        report.add(_judge(n, c, s, PAIR_POINTS, f"beside a {sum(PAIR) - c}% slice"))


def _judge(name: str, cap: int, measured: Share, points: float, where: str) -> Check:
    threshold = f"within +-{points:g} points of {cap}% (the driver's measurement)"
    share = measured.achieved
    if share is None:
        return Check(name, FAIL, f"cap {cap}% {where}: host NVML never listed the process "
                     "(run on the node: the driver names host PIDs)", threshold)  # fmt: skip
    err = share - cap
    status = PASS if abs(err) <= points else FAIL
    detail = f"cap {cap}% {where}: the driver measured {share:.1f}% ({err:+.1f} points)"
    if status == FAIL and err < 0 and starved(measured.cpu_wait_s, measured.window_s):
        # Too little, with the probe kept off the CPU: the node was busy, not the cap wrong.
        # Too much is a failure whatever the node did.
        status = SKIP
        detail = (f"inconclusive: {detail}, but the probe waited for a CPU "
                  f"{100 * measured.cpu_wait:.0f}% of the time (this node's CPUs were busy): "
                  "rerun on an idle node")  # fmt: skip
    numbers = {"cap": cap, "achieved": round(share, 2), "error_points": round(err, 2),
               "cpu_wait_fraction": round(measured.cpu_wait, 3)}  # fmt: skip
    return Check(name, status, detail, threshold, numbers)


@dataclass(frozen=True)
class Share:
    achieved: float | None  # percent, the driver's measurement; None: NVML never listed it
    cpu_wait_s: float  # how long the probe's threads waited for a CPU during the window
    window_s: float

    @property
    def cpu_wait(self) -> float:
        """The fraction of the window the probe's threads waited for a CPU."""
        return self.cpu_wait_s / self.window_s if self.window_s > 0 else 0.0


def _measure(runner: Runner, device: int, caps: list[int], timing: Timing) -> list[Share]:
    """Start one spinning slice per cap at once; the driver's measurement of each."""
    seconds = timing.warmup_s + timing.window_s + 1.0
    procs: list[subprocess.Popen[str]] = []
    try:
        for i, cap in enumerate(caps):
            env = runner.slice_env(f"cpu-{i}-{cap}", compute=cap)
            procs.append(runner.start(env, "spin", str(device), str(KERNEL_NS), str(seconds)))
        pids = [_started(p) for p in procs]
        time.sleep(timing.warmup_s)
        view = NvmlView(device)
        waited = [cpu_wait_ns(pid) for pid in pids]
        try:
            shares = view.share_of(pids, timing.window_s)
        finally:
            view.close()
        waited = [cpu_wait_ns(pid) - w for pid, w in zip(pids, waited, strict=True)]
        for p in procs:
            _, err = p.communicate(timeout=seconds + 120)
            if p.returncode != 0:
                raise ProbeError(f"probe spin exited {p.returncode}: {last_line(err)}")
        return [
            Share(shares[pid], w / 1e9, timing.window_s)
            for pid, w in zip(pids, waited, strict=True)
        ]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _started(p: subprocess.Popen[str]) -> int:
    """The probe's PID once its kernel is loaded and it starts launching."""
    assert p.stdout is not None
    line = p.stdout.readline()
    kv = parse_kv(line)
    if "pid" not in kv:
        p.wait()
        err = p.stderr.read() if p.stderr else ""
        raise ProbeError(f"probe spin did not start: {last_line(err)}")
    return int(kv["pid"])

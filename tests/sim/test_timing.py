"""Kernel durations vary as on hardware, and processes time-slice the device (tests/c/sim_timing.c).

Durations are read from events between kernels queued back to back: simulated times, so host
load does not decide the results. The time-slicing tests run two processes; each queues a warm-up
kernel before its timing events, so an event completes when the warm-up does, not when it was
recorded: the host may be descheduled for as long as the warm-up runs between an event and the
launch it brackets (a loaded CI machine stretched that gap to 0.39 ms) without changing a result.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.sim.simhelp import EXACT_DURATIONS

pytestmark = pytest.mark.slow

# A's events bracket its launch call as well as its kernel (the work is queued at the call's end);
# without the call's host time (3 us, more when a loaded host deschedules the thread mid-call)
# they bracket the kernel alone.
NO_LAUNCH_COST = {"SIMGPU_LAUNCH_COST_NS": "0"}

CUDA_ERROR_NOT_READY = 600


@pytest.fixture
def timing(build_c: Callable[..., Path]) -> Path:
    return build_c("sim_timing.c")


# Queue up to 1024 launches ahead (SIM_PACE) whatever their total time, so that the launching
# process being descheduled on a loaded machine never lets the device run dry between kernels
# (an idle gap between two events is real time between them, on hardware too).
DEEP_QUEUE = {"SIMGPU_QUEUE_AHEAD_US": "10000000"}


def _durations(exe: Path, env: dict[str, str], name: str, n: int) -> list[float]:
    r = subprocess.run(
        [str(exe), "durations", name, str(n)],
        env=dict(env, **DEEP_QUEUE),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = [float(x) for x in r.stdout.split()]
    assert len(out) == n
    return out


def test_default_spread_keeps_the_mean(timing: Path, sim_env: dict[str, str]) -> None:
    """Default: lognormal, 20 % coefficient of variation, plus a rare long tail; mean = modelled."""
    d = _durations(timing, dict(sim_env, SIMGPU_SEED="1"), "sim_200us", 3000)
    mean = statistics.fmean(d)
    cv = statistics.pstdev(d) / mean
    assert 194 < mean < 206, mean  # +-3 % (the standard error is about 0.4 %)
    assert 0.17 < cv < 0.27, cv  # 20 % spread, a little more with the 0.1 % tail at 4x
    assert min(d) > 60 and max(d) > 300  # a spread, not a constant
    assert len(set(d)) > 2900  # every draw differs


def test_seed_reproduces_the_draws(timing: Path, sim_env: dict[str, str]) -> None:
    a = _durations(timing, dict(sim_env, SIMGPU_SEED="7"), "sim_100us", 200)
    b = _durations(timing, dict(sim_env, SIMGPU_SEED="7"), "sim_100us", 200)
    c = _durations(timing, dict(sim_env, SIMGPU_SEED="8"), "sim_100us", 200)
    assert a == b
    assert a != c


def test_spread_off_gives_exact_durations(timing: Path, sim_env: dict[str, str]) -> None:
    d = _durations(timing, dict(sim_env, **EXACT_DURATIONS), "sim_200us", 300)
    assert all(abs(x - 200.0) < 0.002 for x in d), sorted(d)[:3] + sorted(d)[-3:]


def test_long_tail(timing: Path, sim_env: dict[str, str]) -> None:
    """10 % of kernels take 4x; the draws are scaled so the mean stays the modelled time."""
    env = dict(
        sim_env,
        SIMGPU_KERNEL_SPREAD_PCT="0",
        SIMGPU_KERNEL_TAIL_PPM="100000",
        SIMGPU_KERNEL_TAIL_FACTOR="4",
        SIMGPU_SEED="3",
    )
    d = _durations(timing, env, "sim_260us", 2000)
    short, long = 260 / 1.3, 4 * 260 / 1.3  # E[multiplier] = 0.9 + 0.1 * 4 = 1.3
    assert all(abs(x - short) < 0.01 or abs(x - long) < 0.01 for x in d)
    frac = sum(1 for x in d if x > 2 * short) / len(d)
    assert 0.07 < frac < 0.13, frac
    assert 250 < statistics.fmean(d) < 270


def test_bad_knobs_use_the_defaults(timing: Path, sim_env: dict[str, str]) -> None:
    env = dict(
        sim_env,
        SIMGPU_KERNEL_SPREAD_PCT="lots",
        SIMGPU_KERNEL_TAIL_FACTOR="0",
        SIMGPU_TIMESLICE_US="5",
        SIMGPU_SEED="1",
    )
    r = subprocess.run(
        [str(timing), "durations", "sim_100us", "50"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0
    lines = r.stderr.splitlines()
    assert any("SIMGPU_KERNEL_SPREAD_PCT" in x and "using 20" in x for x in lines), r.stderr
    assert any("SIMGPU_KERNEL_TAIL_FACTOR" in x and "allowed: 1 .. 100" in x for x in lines)
    assert any("SIMGPU_TIMESLICE_US" in x and "allowed: 100 .. 1000000" in x for x in lines)


# A's warm-up (100 ms) leaves its host that long to queue its timing events and long kernel.
LONG_WARM_US = 100000


def _slice_pair(
    exe: Path, env: dict[str, str], tmp_path: Path, long_us: int, short_us: int, short_warm_us: int
) -> tuple[dict[str, float], dict[str, float]]:
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    a = subprocess.Popen(
        [str(exe), "long", str(long_us), str(LONG_WARM_US), str(fifo)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    b = subprocess.Popen(
        [str(exe), "short", str(short_us), str(short_warm_us), str(fifo)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    out_a, _ = a.communicate(timeout=60)
    out_b, _ = b.communicate(timeout=60)
    assert a.returncode == 0 and b.returncode == 0
    return json.loads(out_a), json.loads(out_b)


def test_time_slicing_between_processes(
    timing: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """B's work (a 40 ms warm-up, then a 100 us kernel), launched while A's 200 ms kernel runs, gets
    the device at A's next slice boundary (50 ms slices here; FIFO would make it wait for A's
    whole kernel) and runs within one slice; A's kernel ends 40.1 ms later, A's query said "not
    ready" and its synchronisation returned only after the (moved) end.

    The slice is longer than the default 2 ms so that B's warm-up, which must fit in one slice,
    gives B's host 40 ms to queue its timing events and kernel."""
    env = dict(sim_env, SIMGPU_TIMESLICE_US="50000", **EXACT_DURATIONS, **NO_LAUNCH_COST)
    a, b = _slice_pair(timing, env, tmp_path, 200000, 100, 40000)
    # The proof is in device time, not in wall time (which a loaded host stretches): A's kernel
    # ended exactly B's 40.1 ms late, so B's work ran inside A's kernel; under FIFO it would have
    # waited for the rest of A's kernel and A's events would span exactly 200 ms.
    assert 0.099 < b["event_ms"] < 0.101, b  # B's events bracket its own 0.1 ms, nothing of A's
    assert 240.099 < a["event_ms"] < 240.101, a  # delayed by exactly B's work
    assert a["query_halfway"] == CUDA_ERROR_NOT_READY
    assert a["wall_ms"] >= a["event_ms"] - 0.05, a


def test_timeslice_knob(timing: Path, sim_env: dict[str, str], tmp_path: Path) -> None:
    """With a slice (1 s) longer than A's kernel, B waits for all of it (whole-launch FIFO)."""
    env = dict(sim_env, SIMGPU_TIMESLICE_US="1000000", **EXACT_DURATIONS, **NO_LAUNCH_COST)
    a, b = _slice_pair(timing, env, tmp_path, 200000, 5000, 0)
    assert b["wall_ms"] > 100, b  # the rest of A's kernel, however late B's host was
    # B's 5 ms kernel did not cut into A's: A's events span its kernel alone
    assert 199.999 < a["event_ms"] < 200.001, a
    # B's first event, recorded while A held the device, completed when B's lane got it: B's
    # events bracket its own kernel, not the wait
    assert 4.999 < b["event_ms"] < 5.001, b

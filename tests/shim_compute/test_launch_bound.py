"""Launch-bound work under a cap: a launch is charged the device time its kernel took, not the
host's time between launches (docs/compute.md, "What a launch is charged").

How much of the device a launch-bound program keeps busy depends on how fast its host thread
launches, which a loaded machine changes. So these tests compare two figures that do not depend
on the host's speed: what the slice was charged (charged_ns in the accounting file) and the
device time the simulator served the process over the same run (simgpuProcessBusyNs, its own
accounting). Shares of wall time are bounded only from above: a slow host can only lower them.
The simulated launch costs the host 20 us here (SIMGPU_LAUNCH_COST_NS), so kernels of 1-5 us
leave the device idle most of the time and a charge of the host's gaps would be 4-20 times the
device time. The NVML loop is off: the events alone must get it right.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.compute_workload import Result, Workload, compute_state

pytestmark = pytest.mark.slow

HOST_COST = {"SIMGPU_LAUNCH_COST_NS": "20000", "VGPU_COMPUTE_NVML": "0"}
RUN = ("--warmup", "0.3", "--seconds", "1")


def charge_ratio(workload: Workload, env: dict[str, str], r: Result) -> tuple[float, Any]:
    assert r.returncode == 0, r.stderr
    st = compute_state(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
    assert st.launches == r.launches_run, (st.launches, r.stdout)
    assert r.busy_run_ns > 0, r.stdout
    return st.charged_ns / r.busy_run_ns, st


@pytest.mark.parametrize("kernel", ["sim_1us", "sim_2us", "sim_5us"])
def test_launch_bound_kernels_are_charged_their_device_time(
    workload: Workload, kernel: str
) -> None:
    env = workload.env("a", True, CUDA_DEVICE_SM_LIMIT="50", **HOST_COST)
    r = workload.run(env, "--kernel", kernel, *RUN)
    ratio, st = charge_ratio(workload, env, r)
    # Charging the time between the timing events (mostly the 20 us launch) gives 4..20.
    assert 0.8 < ratio < 1.5, (ratio, r.stdout)
    # Such a program uses at most 20% of the device: a 50% cap never holds it back.
    assert st.throttled == 0, (st.throttled, r.stdout)


def test_empty_kernels_cost_next_to_nothing(workload: Workload) -> None:
    # 0 us kernels: no device time at all. Charged the host's gaps, a 50% cap halved their
    # launch rate; now the charge per launch is a small part of a launch's host time.
    env = workload.env("a", True, CUDA_DEVICE_SM_LIMIT="50", **HOST_COST)
    r = workload.run(env, "--kernel", "sim_0us", *RUN)
    assert r.returncode == 0, r.stderr
    st = compute_state(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
    assert st.launches == r.launches_run > 1000, r.stdout
    assert st.charged_ns / st.launches < 5000, (st.charged_ns / st.launches, r.stdout)
    assert st.throttled == 0, (st.throttled, r.stdout)


def test_launch_bound_kernels_beside_a_busy_neighbour(workload: Workload) -> None:
    # The neighbour keeps the device busy; while it holds the device, the capped process's
    # timing events wait for their turn and span the neighbour's slices, not its own work.
    nb = workload.start(
        workload.env("neighbour"), "--kernel", "sim_2000us", "--warmup", "0", "--seconds", "2"
    )
    env = workload.env("a", True, CUDA_DEVICE_SM_LIMIT="50", **HOST_COST)
    r = workload.run(env, "--kernel", "sim_2us", *RUN)
    assert workload.wait(nb).returncode == 0
    ratio, _ = charge_ratio(workload, env, r)
    assert 0.8 < ratio < 1.5, (ratio, r.stdout)


def test_a_binding_cap_holds_launch_bound_work_to_it(workload: Workload) -> None:
    # 5 us kernels with the default 3 us launch keep the device busy more than half the time
    # uncapped (on an idle host): a 30% cap holds them to 30%, charging their device time.
    env = workload.env(CUDA_DEVICE_SM_LIMIT="30", VGPU_COMPUTE_NVML="0")
    r = workload.run(env, "--kernel", "sim_5us", *RUN)
    ratio, _ = charge_ratio(workload, env, r)
    assert 0.9 < ratio < 1.3, (ratio, r.stdout)
    assert r.share < 33, r.stdout


@pytest.mark.parametrize(
    "how, args",
    [
        # Spacing: 30 us of host work after every launch; each starts on an idle device.
        ("spaced", ("--gap-us", "30")),
        # Batching: 100 launches back to back, then 3 ms of host work; the batch queues up.
        ("batched", ("--burst", "100", "--gap-us", "3000")),
    ],
)
def test_spacing_or_batching_launches_does_not_lower_the_charge(
    workload: Workload, how: str, args: tuple[str, ...]
) -> None:
    # Uncapped, either program keeps the device busy about 40% of the time (20 us kernels, on an
    # idle host); under a 20% cap it is charged all of its device time and gets no more than
    # its cap. (Whether the cap binds depends on the host's speed; the charge does not.)
    env = workload.env(CUDA_DEVICE_SM_LIMIT="20", VGPU_COMPUTE_NVML="0")
    r = workload.run(env, "--kernel", "sim_20us", *args, *RUN)
    ratio, _ = charge_ratio(workload, env, r)
    assert ratio > 0.95, (how, ratio, r.stdout)
    assert r.share < 22, (how, r.share, r.stdout)

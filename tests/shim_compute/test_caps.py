"""Behavioural tests of the compute cap on the simulated GPU (wide bounds: not the benchmark).

Each workload reports its own share of device time, computed exactly from the simulator's kernel
model over a window bracketed by cuCtxSynchronize (tests/c/compute_workload.c). A cap is an upper
bound, judged always; a share's lower bound is judged only where the host let the workload run
(at_least: a process kept waiting for a CPU launches nothing, through no fault of the cap).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.compute_workload import Workload, at_least, host_starved

pytestmark = pytest.mark.slow

SHORT = ("--warmup", "0.5", "--seconds", "2")


def test_workload_saturates_without_cap(workload: Workload) -> None:
    r = workload.run(workload.env(), *SHORT)
    assert r.returncode == 0, r.stderr
    assert at_least(r, 80), r.stdout


def test_cap_holds_when_alone(workload: Workload) -> None:
    r = workload.run(workload.env(CUDA_DEVICE_SM_LIMIT="30"), *SHORT)
    assert r.returncode == 0, r.stderr
    assert r.share < 40 and at_least(r, 20), r.stdout


@pytest.mark.parametrize(
    "path", ["kernel", "ptsz", "ex", "ex_ptsz", "coop", "coop_ptsz", "graph", "graph_ptsz"]
)
def test_every_launch_path_is_throttled(workload: Workload, path: str) -> None:
    r = workload.run(
        workload.env(CUDA_DEVICE_SM_LIMIT="30"), "--path", path, "--graph-nodes", "4", *SHORT
    )
    assert r.returncode == 0, r.stderr
    assert r.share < 40 and at_least(r, 15), (path, r.stdout)


@pytest.mark.parametrize("kernel", ["sim_50us", "sim_20000us"])
def test_short_and_long_kernels(workload: Workload, kernel: str) -> None:
    r = workload.run(workload.env(CUDA_DEVICE_SM_LIMIT="30"), "--kernel", kernel, *SHORT)
    assert r.returncode == 0, r.stderr
    assert r.share < 40 and at_least(r, 15), (kernel, r.stdout)


def test_launch_then_synchronize(workload: Workload) -> None:
    r = workload.run(workload.env(CUDA_DEVICE_SM_LIMIT="30"), "--sync-every", "1", *SHORT)
    assert r.returncode == 0, r.stderr
    assert r.share < 40 and at_least(r, 15), r.stdout


def test_processes_of_a_slice_share_one_budget(workload: Workload) -> None:
    env = workload.env("shared", CUDA_DEVICE_SM_LIMIT="30")
    ps = [workload.start(env, *SHORT) for _ in range(3)]
    rs = [workload.wait(p) for p in ps]
    for r in rs:
        assert r.returncode == 0, r.stderr
    total = sum(r.share for r in rs)
    assert total < 40 and (total > 15 or any(host_starved(r) for r in rs)), [r.stdout for r in rs]


def test_threads_of_a_process_share_one_budget(workload: Workload) -> None:
    r = workload.run(workload.env(CUDA_DEVICE_SM_LIMIT="30"), "--threads", "3", *SHORT)
    assert r.returncode == 0, r.stderr
    assert r.share < 40 and at_least(r, 15), r.stdout


def test_throttled_process_sleeps(workload: Workload) -> None:
    r = workload.run(workload.env(CUDA_DEVICE_SM_LIMIT="10"), "--kernel", "sim_5000us", *SHORT)
    assert r.returncode == 0, r.stderr
    assert r.share < 20, r.stdout
    # A sleeping thread costs (almost) no CPU; generous bound for a loaded test machine.
    assert r.cpu_s / r.total_s < 0.10, r.stdout


def test_policy_off_does_not_throttle(workload: Workload) -> None:
    env = workload.env(CUDA_DEVICE_SM_LIMIT="30", VGPU_COMPUTE_POLICY="off")
    r = workload.run(env, *SHORT)
    assert r.returncode == 0, r.stderr
    assert at_least(r, 80), r.stdout
    env = workload.env(CUDA_DEVICE_SM_LIMIT="30", GPU_CORE_UTILIZATION_POLICY="disable")
    r = workload.run(env, *SHORT)
    assert at_least(r, 80), r.stdout


def test_alias_force_is_hard(workload: Workload) -> None:
    env = workload.env(CUDA_DEVICE_SM_LIMIT="30", GPU_CORE_UTILIZATION_POLICY="force")
    r = workload.run(env, *SHORT)
    assert r.returncode == 0, r.stderr
    assert r.share < 40, r.stdout


def test_cap_100_and_0_mean_no_cap(workload: Workload) -> None:
    for v in ("0", "100"):
        r = workload.run(workload.env(CUDA_DEVICE_SM_LIMIT=v), *SHORT)
        assert r.returncode == 0, r.stderr
        assert at_least(r, 80), (v, r.stdout)


def test_elastic_lends_idle_time_and_gives_it_back(workload: Workload) -> None:
    a_env = workload.env("a", CUDA_DEVICE_SM_LIMIT="30", VGPU_COMPUTE_POLICY="elastic")
    b_env = workload.env("b", CUDA_DEVICE_SM_LIMIT="70")
    alone = workload.run(a_env, *SHORT)
    assert alone.returncode == 0, alone.stderr
    assert at_least(alone, 80), alone.stdout

    a = workload.start(a_env, "--warmup", "0", "--seconds", "4", "--timeline-ms", "50")
    time.sleep(1.5)
    b = workload.start(b_env, "--warmup", "0.5", "--seconds", "2")
    ra, rb = workload.wait(a), workload.wait(b)
    assert ra.returncode == 0 and rb.returncode == 0, ra.stderr + rb.stderr
    t_b = (rb.start_ns - ra.start_ns) / 1e6  # ms after a's start
    before = [s for t, s in ra.timeline if 300 <= t < t_b - 100]
    after = [s for t, s in ra.timeline if t_b + 150 <= t < t_b + 2000]
    assert before and after, ra.stdout
    assert sum(before) / len(before) > 70, ra.stdout
    assert sum(after) / len(after) < 40, (t_b, ra.stdout)
    assert at_least(rb, 55), rb.stdout


BAD = [
    ("CUDA_DEVICE_SM_LIMIT", "abc"),
    ("CUDA_DEVICE_SM_LIMIT", "-5"),
    ("CUDA_DEVICE_SM_LIMIT_1", "30x"),
    # set but empty, or a device index the shim has no room for: refused as for memory limits
    ("CUDA_DEVICE_SM_LIMIT", ""),
    ("CUDA_DEVICE_SM_LIMIT_0", ""),
    ("CUDA_DEVICE_SM_LIMIT_64", "30"),
    ("CUDA_DEVICE_SM_LIMIT_x", "30"),
    # strtod's extra forms are not percentages
    ("CUDA_DEVICE_SM_LIMIT", "0x10"),
    ("CUDA_DEVICE_SM_LIMIT", "1e1"),
    ("CUDA_DEVICE_SM_LIMIT", "+30"),
    ("VGPU_COMPUTE_POLICY", "soft"),
    ("GPU_CORE_UTILIZATION_POLICY", "sometimes"),
    ("VGPU_PRIORITY", "high"),
    ("CUDA_TASK_PRIORITY", "1000"),
    ("VGPU_NODE_STATE_DIR", "relative/dir"),
]


@pytest.mark.parametrize(("var", "value"), BAD)
def test_bad_values_fail_closed(workload: Workload, var: str, value: str) -> None:
    env = workload.env()
    env[var] = value
    if var != "CUDA_DEVICE_SM_LIMIT":
        env.setdefault("CUDA_DEVICE_SM_LIMIT", "30")
    r = workload.run(env, *SHORT)
    assert r.returncode == 3, r.stdout + r.stderr  # cuInit failed
    assert "cuInit=1" in r.stdout  # CUDA_ERROR_INVALID_VALUE
    lines = [ln for ln in r.stderr.splitlines() if var in ln]
    assert len(lines) == 1 and f'{var}="{value}"' in lines[0] and "accepted" in lines[0], r.stderr


def test_elastic_idle_time_goes_to_higher_priority(workload: Workload) -> None:
    # Two elastic 20% slices: the idle 60% goes to the higher priority (lower number) one;
    # the other keeps its own cap.
    hi = workload.env(
        "hi", CUDA_DEVICE_SM_LIMIT="20", VGPU_COMPUTE_POLICY="elastic", VGPU_PRIORITY="0"
    )
    lo = workload.env(
        "lo", CUDA_DEVICE_SM_LIMIT="20", VGPU_COMPUTE_POLICY="elastic", CUDA_TASK_PRIORITY="1"
    )
    p_hi, p_lo = workload.start(hi, *SHORT), workload.start(lo, *SHORT)
    r_hi, r_lo = workload.wait(p_hi), workload.wait(p_lo)
    assert r_hi.returncode == 0 and r_lo.returncode == 0, r_hi.stderr + r_lo.stderr
    assert at_least(r_hi, 65), (r_hi.stdout, r_lo.stdout)
    assert r_lo.share < 28 and at_least(r_lo, 12), (r_hi.stdout, r_lo.stdout)


def test_two_slices_each_hold_their_cap(workload: Workload) -> None:
    a = workload.start(workload.env("a", CUDA_DEVICE_SM_LIMIT="30"), *SHORT)
    b = workload.start(workload.env("b", CUDA_DEVICE_SM_LIMIT="60"), *SHORT)
    ra, rb = workload.wait(a), workload.wait(b)
    assert ra.returncode == 0 and rb.returncode == 0, ra.stderr + rb.stderr
    assert ra.share < 38 and at_least(ra, 22), ra.stdout
    assert rb.share < 68 and at_least(rb, 50), rb.stdout


def test_each_device_has_its_own_cap(workload: Workload, tmp_path: Path) -> None:
    cfg = tmp_path / "two-gpus.json"
    cfg.write_text('{"devices": [{}, {}]}')
    env = workload.env(
        "multi", SIMGPU_CONFIG=str(cfg), CUDA_DEVICE_SM_LIMIT_0="20", CUDA_DEVICE_SM_LIMIT_1="70"
    )
    p0 = workload.start(env, "--device", "0", *SHORT)
    p1 = workload.start(env, "--device", "1", *SHORT)
    r0, r1 = workload.wait(p0), workload.wait(p1)
    assert r0.returncode == 0 and r1.returncode == 0, r0.stderr + r1.stderr
    assert r0.share < 28 and at_least(r0, 12), r0.stdout
    assert r1.share < 78 and at_least(r1, 60), r1.stdout


def test_accepted_forms_of_a_cap(workload: Workload) -> None:
    for value, lo, hi in (("12.5", 9, 16), ("30%", 24, 36), (" 20 ", 15, 25)):
        r = workload.run(
            workload.env(CUDA_DEVICE_SM_LIMIT=value), "--warmup", "0.5", "--seconds", "1.5"
        )
        assert r.returncode == 0, (value, r.stdout, r.stderr)
        assert r.share < hi and at_least(r, lo), (value, r.stdout)

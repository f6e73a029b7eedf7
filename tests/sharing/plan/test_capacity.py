"""Consumable capacity: defaults, rounding to validRange.step / validValues, refusals, sharers.

Every expected number below is worked out by hand from the request policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sharing.plan.build import (
    free,
    gpu,
    placements,
    request,
    resource_slice,
    run_plan,
    workload,
)

RANGE = {"default": "40Gi", "validRange": {"min": "256Mi", "max": "40Gi", "step": "256Mi"}}
CORES = {"default": "100", "validRange": {"min": "1", "max": "100", "step": "5"}}


def test_amounts_round_up_to_the_next_step_and_up_to_min(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dev = gpu("gpu-0", memory_policy=RANGE, cores_policy=CORES)
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", [dev])],
        [
            # 1000Mi -> 256Mi + 3*256Mi = 1Gi; 12 cores -> 1 + 3*5 = 16
            workload("odd", 1, [request(capacity={"memory": "1000Mi", "cores": "12"})]),
            # 100Mi is below min -> 256Mi; 1 core is min itself
            workload("tiny", 1, [request(capacity={"memory": "100Mi", "cores": "1"})]),
        ],
        capsys,
    )
    assert code == 0
    assert placements(doc) == [
        ("odd", 0, "node-a", "gpu-0", {"cores": "16", "memory": "1Gi"}),
        ("tiny", 0, "node-a", "gpu-0", {"cores": "1", "memory": "256Mi"}),
    ]
    # 40Gi - 1Gi - 256Mi = 38912Mi - 256Mi; 100 - 16 - 1 = 83
    assert free(doc)[("node-a", "gpu-0")] == {"cores": "83", "memory": "39680Mi"}


def test_a_request_naming_no_amount_consumes_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dev = gpu("gpu-0", memory_policy={**RANGE, "default": "10Gi"}, cores_policy=CORES)
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", [dev])],
        # memory default 10Gi, cores default 100: the second replica finds no cores left.
        [workload("plain", 2, [request()])],
        capsys,
    )
    assert code == 1
    assert placements(doc) == [("plain", 0, "node-a", "gpu-0", {"cores": "100", "memory": "10Gi"})]
    [un] = doc["unplaced"]
    assert (un["workload"], un["replica"]) == ("plain", 1)
    assert "not enough cores left (needs 100)" in un["reason"]
    assert "the most left on one device: cores 0" in un["reason"]


def test_no_policy_means_the_whole_capacity_when_unnamed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dev = gpu("gpu-0")  # no request policies at all
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", [dev])],
        [workload("w", 1, [request(capacity={"memory": "3Gi"})])],
        capsys,
    )
    assert code == 0
    # memory exactly as asked (no policy to round), cores unnamed: all 100.
    assert placements(doc)[0][4] == {"cores": "100", "memory": "3Gi"}


def test_above_valid_range_max_the_device_does_not_match(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = {"default": "8Gi", "validRange": {"min": "1Gi", "max": "32Gi", "step": "1Gi"}}
    dev = gpu("gpu-0", memory_policy=policy)
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", [dev])],
        [workload("big", 1, [request(capacity={"memory": "33Gi"})])],
        capsys,
    )
    assert code == 1
    assert doc["placed"] == []
    reason = doc["unplaced"][0]["reason"]
    assert reason.startswith("request gpu: no device can serve it")
    assert "memory 33Gi is above validRange.max" in reason
    assert free(doc)[("node-a", "gpu-0")] == {"cores": "100", "memory": "40Gi"}


def test_valid_values_round_up_and_refuse_above_the_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = {"default": "10Gi", "validValues": ["5Gi", "10Gi", "20Gi"]}
    dev = gpu("gpu-0", memory_policy=policy, cores_policy=CORES)
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", [dev])],
        [
            workload("mid", 1, [request(capacity={"memory": "6Gi", "cores": "10"})]),
            workload("huge", 1, [request(capacity={"memory": "21Gi", "cores": "10"})]),
        ],
        capsys,
    )
    assert code == 1
    # 6Gi -> 10Gi (the next listed value); 10 cores -> 1 + 2*5 = 11 (min + whole steps).
    assert placements(doc) == [("mid", 0, "node-a", "gpu-0", {"cores": "11", "memory": "10Gi"})]
    assert "memory 21Gi is above every validValues entry" in doc["unplaced"][0]["reason"]


def test_a_device_without_multiple_allocations_is_taken_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    devs = [gpu("gpu-0", shared=False), gpu("gpu-1", shared=False)]
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", devs)],
        [workload("w", 3, [request(capacity={"memory": "1Gi"})])],
        capsys,
    )
    assert code == 1
    assert [(p[3], p[4]) for p in placements(doc)] == [
        ("gpu-0", {"cores": "100", "memory": "40Gi"}),
        ("gpu-1", {"cores": "100", "memory": "40Gi"}),
    ]
    assert "2 device(s): taken whole by another claim" in doc["unplaced"][0]["reason"]
    assert free(doc)[("node-a", "gpu-0")] == {"cores": "0", "memory": "0"}


def test_sharers_capacity_of_the_admin_policy_limits_allocations_per_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The admin policy publishes maxSharers as capacity `sharers` with
    requestPolicy {default: 1, validValues: [1]}: every allocation takes exactly one."""
    devs = [
        gpu("gpu-0", memory_policy=RANGE, cores_policy=CORES, sharers=3),
        gpu("gpu-1", memory_policy=RANGE, cores_policy=CORES, sharers=3),
    ]
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", devs)],
        [
            workload("small", 7, [request(capacity={"memory": "1Gi", "cores": "1"})]),
            workload(
                "greedy", 1, [request(capacity={"memory": "1Gi", "cores": "1", "sharers": "2"})]
            ),
        ],
        capsys,
    )
    assert code == 1
    got = [(p[1], p[3], p[4]["sharers"]) for p in placements(doc)]
    assert got == [
        (0, "gpu-0", "1"),
        (1, "gpu-0", "1"),
        (2, "gpu-0", "1"),
        (3, "gpu-1", "1"),
        (4, "gpu-1", "1"),
        (5, "gpu-1", "1"),
    ]
    un = {(u["workload"], u["replica"]): u["reason"] for u in doc["unplaced"]}
    assert "not enough sharers left (needs 1)" in un[("small", 6)]
    assert "sharers 2 is above every validValues entry" in un[("greedy", 0)]
    # Memory and cores are left: sharers is what ran out.
    assert free(doc)[("node-a", "gpu-0")] == {"cores": "97", "memory": "37Gi", "sharers": "0"}

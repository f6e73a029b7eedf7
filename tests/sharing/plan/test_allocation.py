"""Multi-device claims, constraints across requests, All / firstAvailable, first-fit order,
partition-mode slices and pool completeness."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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

ROOT = "resource.kubernetes.io/pcieRoot"
SAME_ROOT = {"matchAttribute": ROOT}


def test_match_attribute_backtracks_to_a_pair_on_one_pcie_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # gpu-0 alone on root A; gpu-1 and gpu-2 share root B. First fit would give "a" gpu-0,
    # then "b" finds no other device on root A: the allocator must go back and move "a".
    devs = [gpu("gpu-0", root="pciA"), gpu("gpu-1", root="pciB"), gpu("gpu-2", root="pciB")]
    whole = {"memory": "40Gi"}
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", [gpu_unshared(d) for d in devs])],
        [
            workload(
                "pair",
                1,
                [request("a", capacity=whole), request("b", capacity=whole)],
                [{**SAME_ROOT, "requests": ["a", "b"]}],
            )
        ],
        capsys,
    )
    assert code == 0
    assert [p[3] for p in placements(doc)] == ["gpu-1", "gpu-2"]


def gpu_unshared(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != "allowMultipleAllocations"}


def test_match_attribute_that_no_node_satisfies_is_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    devs = [gpu_unshared(gpu("gpu-0", root="pciA")), gpu_unshared(gpu("gpu-1", root="pciB"))]
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", devs)],
        [workload("pair", 1, [request("a"), request("b")], [SAME_ROOT])],
        capsys,
    )
    assert code == 1
    assert doc["unplaced"][0]["reason"] == (
        "no node has devices for every request that also satisfy "
        f"matchAttribute {ROOT} (all requests)"
    )


def test_a_shared_device_serves_two_requests_of_one_claim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", [gpu("gpu-0")])],
        [
            workload(
                "two",
                1,
                [
                    request("a", capacity={"memory": "10Gi", "cores": "30"}),
                    request("b", capacity={"memory": "10Gi", "cores": "30"}),
                ],
            )
        ],
        capsys,
    )
    assert code == 0
    assert [p[3] for p in placements(doc)] == ["gpu-0", "gpu-0"]
    assert free(doc)[("node-a", "gpu-0")] == {"cores": "40", "memory": "20Gi"}


def test_count_two_needs_two_distinct_devices_on_one_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slices = [
        resource_slice("node-a", [gpu("gpu-0")]),
        resource_slice("node-b", [gpu("gpu-0"), gpu("gpu-1")]),
    ]
    code, doc = run_plan(
        tmp_path,
        slices,
        [workload("dual", 2, [request(count=2, capacity={"memory": "30Gi", "cores": "10"})])],
        capsys,
    )
    assert code == 1
    assert [(p[2], p[3]) for p in placements(doc)] == [("node-b", "gpu-0"), ("node-b", "gpu-1")]
    assert (
        doc["unplaced"][0]["reason"] == "request gpu: needs 2 devices, at most 1 usable on one node"
    )


def test_all_mode_takes_every_matching_device_of_a_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slices = [resource_slice("node-a", [gpu("gpu-0"), gpu("gpu-1"), gpu("gpu-2", product="T4")])]
    sel = 'device.attributes["vgpu.sharing.dev"].productName.startsWith("NVIDIA")'
    code, doc = run_plan(
        tmp_path,
        slices,
        [
            workload(
                "all",
                1,
                [request(mode="All", selectors=[sel], capacity={"memory": "1Gi", "cores": "1"})],
            )
        ],
        capsys,
    )
    assert code == 0
    assert [p[3] for p in placements(doc)] == ["gpu-0", "gpu-1"]


def test_first_available_takes_the_first_subrequest_that_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = {"deviceClassName": "vgpu.sharing.dev", "capacity": {"requests": {"memory": "30Gi"}}}
    small = {"deviceClassName": "vgpu.sharing.dev", "capacity": {"requests": {"memory": "8Gi"}}}
    req = {"name": "gpu", "firstAvailable": [{"name": "big", **big}, {"name": "small", **small}]}
    code, doc = run_plan(
        tmp_path,
        [
            resource_slice(
                "node-a",
                [
                    gpu(
                        "gpu-0",
                        cores_policy={
                            "default": "10",
                            "validRange": {"min": "1", "max": "100", "step": "1"},
                        },
                    )
                ],
            )
        ],
        [workload("flex", 3, [req])],
        capsys,
    )
    # 40Gi, no memory policy: replica 0 gets "big" (30Gi); replica 1 cannot (10Gi left) and
    # gets "small" (8Gi); replica 2 fits neither (2Gi left).
    assert code == 1
    assert [p[4]["memory"] for p in placements(doc)] == ["30Gi", "8Gi"]
    reason = doc["unplaced"][0]["reason"]
    assert "request gpu/big: no device can serve it" in reason
    assert "request gpu/small: no device can serve it" in reason
    assert "the most left on one device: memory 2Gi" in reason


def test_distinct_attribute_spreads_over_roots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    devs = [gpu("gpu-0", root="pciA"), gpu("gpu-1", root="pciA"), gpu("gpu-2", root="pciB")]
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", devs)],
        [
            workload(
                "spread",
                1,
                [request(count=2, capacity={"memory": "1Gi", "cores": "1"})],
                [{"distinctAttribute": ROOT}],
            )
        ],
        capsys,
    )
    assert code == 0
    assert [p[3] for p in placements(doc)] == ["gpu-0", "gpu-2"]


def test_first_fit_goes_by_node_name_and_fills_a_node_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slices = [resource_slice("node-b", [gpu("gpu-0")]), resource_slice("node-a", [gpu("gpu-0")])]
    code, doc = run_plan(
        tmp_path,
        slices,
        [workload("w", 3, [request(capacity={"memory": "20Gi", "cores": "10"})])],
        capsys,
    )
    assert code == 0
    assert [p[2] for p in placements(doc)] == ["node-a", "node-a", "node-b"]


def test_partition_mode_slices_are_whole_devices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Partition mode as the plugin publishes it: N fixed devices per GPU, no sharing."""
    parts = []
    for k in range(4):
        parts.append(
            {
                "name": f"gpu-0-slice-{k}",
                "attributes": {"partition": {"int": k}, "partitionCount": {"int": 4}},
                "capacity": {"memory": {"value": "10Gi"}, "cores": {"value": "25"}},
            }
        )
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", parts)],
        [
            workload("fits", 3, [request(capacity={"memory": "8Gi"})]),
            workload("too-big", 1, [request(capacity={"memory": "12Gi"})]),
        ],
        capsys,
    )
    assert code == 1
    assert [(p[3], p[4]) for p in placements(doc)] == [
        (f"gpu-0-slice-{k}", {"cores": "25", "memory": "10Gi"}) for k in range(3)
    ]
    assert "memory 12Gi is more than the device has" in doc["unplaced"][0]["reason"]
    assert free(doc)[("node-a", "gpu-0-slice-3")] == {"cores": "25", "memory": "10Gi"}


def test_an_incomplete_pool_is_left_out_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sharing.cli.main import main
    from tests.sharing.plan.build import write_inputs

    s, w = write_inputs(
        tmp_path,
        [
            resource_slice("node-a", [gpu("gpu-0")], k=0, count=2),
            resource_slice("node-b", [gpu("gpu-0")]),
        ],
        [workload("w", 1, [request()])],
    )
    assert main(["plan", "--slices", str(s), "--workloads", str(w)]) == 0
    captured = capsys.readouterr()
    assert "pool node-a of driver vgpu.sharing.dev: 1 of 2 ResourceSlices" in captured.err
    assert "node-a" not in captured.out


def test_a_tainted_device_needs_a_toleration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tainted = gpu("gpu-0")
    tainted["taints"] = [{"key": "maintenance", "value": "true", "effect": "NoSchedule"}]
    informational = gpu("gpu-1")
    informational["taints"] = [{"key": "note", "effect": "None"}]
    tolerant = request("gpu", capacity={"memory": "40Gi"})
    tolerant["exactly"]["tolerations"] = [{"key": "maintenance", "operator": "Exists"}]
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", [tainted, informational])],
        [
            workload("plain", 2, [request("gpu", capacity={"memory": "40Gi"})]),
            workload("tolerant", 1, [tolerant]),
        ],
        capsys,
    )
    assert code == 1
    assert [(p[0], p[3]) for p in placements(doc)] == [("plain", "gpu-1"), ("tolerant", "gpu-0")]
    reason = doc["unplaced"][0]["reason"]
    assert "1 device(s): taint maintenance=true:NoSchedule not tolerated" in reason


def test_existing_claims_allocations_are_planned_around(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ResourceClaims given with --slices (kubectl get resourceclaims -A -o yaml) hold their
    devices: consumedCapacity on shared devices, the whole device otherwise."""
    import yaml

    from sharing.cli.main import main
    from tests.sharing.plan.build import write_inputs

    def claim(name: str, results: list[dict[str, Any]] | None) -> dict[str, Any]:
        status = {"allocation": {"devices": {"results": results}}} if results else {}
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "team"},
            "spec": {"devices": {"requests": []}},
            "status": status,
        }

    def result(device: str, consumed: dict[str, str] | None = None) -> dict[str, Any]:
        r: dict[str, Any] = {
            "request": "gpu",
            "driver": "vgpu.sharing.dev",
            "pool": "node-a",
            "device": device,
        }
        if consumed:
            r["consumedCapacity"] = consumed
        return r

    s, w = write_inputs(
        tmp_path,
        [resource_slice("node-a", [gpu("gpu-0"), gpu_unshared(gpu("gpu-1"))])],
        [workload("w", 2, [request(capacity={"memory": "8Gi", "cores": "10"})])],
    )
    claims = tmp_path / "claims.yaml"
    claims.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "List",
                "items": [
                    claim("shared", [result("gpu-0", {"memory": "30Gi", "cores": "50"})]),
                    claim("whole", [result("gpu-1")]),
                    claim("pending", None),
                    claim("gone", [result("gpu-9")]),
                ],
            }
        )
    )
    code = main(
        ["plan", "--slices", str(s), "--slices", str(claims), "--workloads", str(w), "--json"]
    )
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    # gpu-0 has 10Gi left: one replica; gpu-1 is held whole by team/whole.
    assert code == 1
    assert [(p[3], p[4]) for p in placements(doc)] == [("gpu-0", {"cores": "10", "memory": "8Gi"})]
    assert free(doc)[("node-a", "gpu-0")] == {"cores": "40", "memory": "2Gi"}
    assert free(doc)[("node-a", "gpu-1")] == {"cores": "0", "memory": "0"}
    assert (
        "claim team/gone: allocated device vgpu.sharing.dev/node-a/gpu-9 is not in the slices"
        in captured.err
    )


def test_all_mode_fails_when_one_matching_device_is_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = run_plan(
        tmp_path,
        [resource_slice("node-a", [gpu("gpu-0"), gpu("gpu-1")])],
        [
            workload("filler", 1, [request(capacity={"memory": "40Gi", "cores": "1"})]),
            workload("all", 1, [request(mode="All", capacity={"memory": "1Gi", "cores": "1"})]),
        ],
        capsys,
    )
    assert code == 1
    assert [p[0] for p in placements(doc)] == ["filler"]
    assert doc["unplaced"][0]["reason"] == (
        "request gpu: allocationMode All needs every matching device of a node, and no node "
        "has them all free (1 device(s): not enough memory left (needs 1Gi))"
    )


def test_progress_is_reported_every_thousand_replicas_and_at_the_end(tmp_path: Path) -> None:
    from sharing.plan.cel_eval import SelectorEvaluator
    from sharing.plan.loader import load_slices, load_workloads
    from sharing.plan.planner import plan, prepare
    from tests.sharing.plan.build import write_inputs

    s, w = write_inputs(
        tmp_path,
        [resource_slice("node-a", [gpu("gpu-0")])],
        [workload("w", 2500, [request(capacity={"memory": "256Mi", "cores": "1"})])],
    )
    inv, classes = load_slices(s)
    workloads, _ = load_workloads(w)
    ev = SelectorEvaluator()
    seen: list[tuple[int, int]] = []
    result = plan(
        inv, workloads, prepare(workloads, classes, ev, w), ev, lambda d, t: seen.append((d, t))
    )
    assert seen == [(1000, 2500), (2000, 2500), (2500, 2500)]
    # 100 cores, one each: 100 placed (memory: 160 x 256Mi would fit).
    assert len(result.placed) == 100 and len(result.unplaced) == 2400

"""The admin sharing policy in the published ResourceSlices (against the fake API server, which
validates every write with kubernetes-validate and the server's request-policy rules) and in
prepare (a claim choosing a compute policy the admin forbids)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.claims import ClaimError, ClaimRef, plan_claim
from driver.kube import Kube
from driver.policy import PolicyView
from driver.slicepublisher import SlicePublisher
from sharing.gpus import GpuInfo
from sharing.policy import SharingPolicy, from_document
from tests.fakes.apiserver import FakeApiServer, parse_quantity
from tests.support.gpu_records import h100, inventory
from tests.support.slice_publishing import DRIVER, NODE

GiB = 1024**3
MiB = 1024**2
REPO = Path(__file__).resolve().parents[2]

POLICY: dict[str, Any] = {
    "apiVersion": "vgpu.sharing.dev/v1alpha1",
    "kind": "SharingPolicy",
    "default": {
        "reservedMemory": "2Gi",
        "memory": {"min": "1Gi", "step": "256Mi", "default": "4Gi"},
        "cores": {"min": 5, "step": 5, "default": 10},
        "maxSharers": 8,
        "computePolicy": "hard",
        "allowedComputePolicies": [],
        "partitions": 4,
    },
    "overrides": [
        {"match": {"modelName": "NVIDIA A100*"}, "reservedMemory": "4Gi", "partitions": 2},
        {"match": {"nodeLabels": {"vgpu.sharing.dev/pool": "dense"}}, "maxSharers": 32},
    ],
}


def a100(index: int) -> GpuInfo:
    return replace(h100(index, memory=40 * GiB), name="NVIDIA A100-SXM4-40GB")


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as s:
        s.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield s


def publisher(server: FakeApiServer, view: PolicyView, mode: str) -> SlicePublisher:
    return SlicePublisher(
        Kube(server.api_client()),
        driver_name=DRIVER,
        node_name=NODE,
        requested_mode=mode,
        partitions=4,
        rules_for=view.rules,
        on_node_labels=view.set_node_labels,
    )


def devices(server: FakeApiServer) -> dict[str, dict[str, Any]]:
    return {
        d["name"]: d
        for s in server.objects("ResourceSlice")
        for d in s["spec"].get("devices") or []
    }


def test_sharing_slices_follow_the_policy(server: FakeApiServer) -> None:
    view = PolicyView(from_document(POLICY))
    p = publisher(server, view, "sharing")
    assert p.publish(inventory([h100(0, memory=80 * GiB), a100(1)]))
    devs = devices(server)
    h = devs["gpu-0"]["capacity"]
    # 80Gi - 2Gi reserved; max on the 1Gi + k*256Mi grid; the admin's default.
    assert parse_quantity(h["memory"]["value"]) == 78 * GiB
    assert h["memory"]["requestPolicy"] == {
        "default": "4Gi",
        "validRange": {"min": "1Gi", "max": "78Gi", "step": "256Mi"},
    }
    assert h["cores"] == {
        "value": "100",
        "requestPolicy": {"default": "10", "validRange": {"min": "5", "max": "100", "step": "5"}},
    }
    assert h["sharers"] == {
        "value": "8",
        "requestPolicy": {"default": "1", "validValues": ["1"]},
    }
    # The A100 override: 4Gi reserved, everything else from the default.
    a = devs["gpu-1"]["capacity"]
    assert parse_quantity(a["memory"]["value"]) == 36 * GiB
    assert a["memory"]["requestPolicy"]["validRange"]["max"] == "36Gi"
    assert a["sharers"]["value"] == "8"


@pytest.mark.slow
def test_node_label_override_and_a_policy_change_republish(server: FakeApiServer) -> None:
    view = PolicyView(from_document(POLICY))
    p = publisher(server, view, "sharing")
    assert p.publish(inventory([h100(0)]))
    assert devices(server)["gpu-0"]["capacity"]["sharers"]["value"] == "8"
    # The admin labels the node: the next publish reads the labels and the override applies.
    node = server.get("Node", None, NODE)
    assert node is not None
    node["metadata"]["labels"] = {"vgpu.sharing.dev/pool": "dense"}
    server.put(node)
    assert p.publish(inventory([h100(0)]))
    assert devices(server)["gpu-0"]["capacity"]["sharers"]["value"] == "32"
    # A new policy (as the watcher sets it) changes what the same inventory publishes as.
    view.set_policy(SharingPolicy())
    assert p.publish(inventory([h100(0)]))
    cap = devices(server)["gpu-0"]["capacity"]
    assert cap["sharers"]["value"] == "16"
    assert cap["cores"]["requestPolicy"]["default"] == "100"


def test_partition_slices_follow_the_policy(server: FakeApiServer) -> None:
    view = PolicyView(from_document(POLICY))
    p = publisher(server, view, "partition")
    assert p.publish(inventory([h100(0, memory=80 * GiB), a100(1)]))
    devs = devices(server)
    assert sorted(devs) == [
        "gpu-0-slice-0",
        "gpu-0-slice-1",
        "gpu-0-slice-2",
        "gpu-0-slice-3",
        "gpu-1-slice-0",
        "gpu-1-slice-1",
    ]
    assert parse_quantity(devs["gpu-0-slice-0"]["capacity"]["memory"]["value"]) == 78 * GiB // 4
    assert devs["gpu-0-slice-0"]["capacity"]["cores"] == {"value": "25"}
    assert parse_quantity(devs["gpu-1-slice-1"]["capacity"]["memory"]["value"]) == 18 * GiB
    assert devs["gpu-1-slice-1"]["capacity"]["cores"] == {"value": "50"}
    assert devs["gpu-1-slice-1"]["attributes"]["partitionCount"] == {"int": 2}


def claim(results: list[dict[str, Any]], configs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "metadata": {"uid": "uid-1", "name": "c", "namespace": "default"},
        "status": {
            "allocation": {"devices": {"results": results, "config": configs}},
        },
    }


def vgpu_config(source: str, **fields: Any) -> dict[str, Any]:
    return {
        "source": source,
        "opaque": {
            "driver": DRIVER,
            "parameters": {"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig"}
            | fields,
        },
    }


def plan(doc: dict[str, Any], policy: dict[str, Any], mode: str = "sharing") -> Any:
    view = PolicyView(from_document(policy))
    return plan_claim(
        doc,
        ClaimRef("default", "c", "uid-1"),
        driver_name=DRIVER,
        node_name=NODE,
        gpus=[h100(0, memory=80 * GiB), a100(1)],
        mode=mode,
        partitions=4,
        rules_for=view.rules,
    )


SHARE = {
    "request": "gpu",
    "driver": DRIVER,
    "pool": NODE,
    "device": "gpu-0",
    "consumedCapacity": {"memory": "4Gi", "cores": "10", "sharers": "1"},
}


def test_prepare_refuses_a_compute_policy_the_admin_forbids() -> None:
    with pytest.raises(ClaimError) as e:
        plan(claim([SHARE], [vgpu_config("FromClaim", computePolicy="elastic")]), POLICY)
    assert str(e.value) == (
        "device gpu-0: config[0] (FromClaim): VgpuConfig computePolicy 'elastic' is not allowed "
        "by the node's sharing policy (allowedComputePolicies: []); allowed: hard or leave "
        "computePolicy out"
    )
    # Naming the admin's own policy is fine; so is a DeviceClass (admin) config choosing, and a
    # claim naming what its class gives it.
    ok = plan(claim([SHARE], [vgpu_config("FromClaim", computePolicy="hard")]), POLICY)
    assert ok.config.compute_policy == "hard"
    by_class = plan(claim([SHARE], [vgpu_config("FromClass", computePolicy="elastic")]), POLICY)
    assert by_class.config.compute_policy == "elastic"
    both = [
        vgpu_config("FromClass", computePolicy="off"),
        vgpu_config("FromClaim", computePolicy="off"),
    ]
    assert plan(claim([SHARE], both), POLICY).config.compute_policy == "off"


def test_prepare_uses_the_admin_default_and_allows_what_the_admin_lists() -> None:
    elastic = {**POLICY, "default": {**POLICY["default"], "computePolicy": "elastic"}}
    assert plan(claim([SHARE], []), elastic).config.compute_policy == "elastic"
    listed = {**POLICY, "default": {**POLICY["default"], "allowedComputePolicies": ["off"]}}
    chosen = plan(claim([SHARE], [vgpu_config("FromClaim", computePolicy="off")]), listed)
    assert chosen.config.compute_policy == "off"
    with pytest.raises(ClaimError, match="allowed: hard, off or leave computePolicy out"):
        plan(claim([SHARE], [vgpu_config("FromClaim", computePolicy="elastic")]), listed)


def shipped_policy() -> dict[str, Any]:
    path = REPO / "deploy" / "base" / "policy.yaml"
    [cm] = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "ConfigMap"]
    doc: dict[str, Any] = yaml.safe_load(cm["data"]["policy.yaml"])
    return doc


BUILTIN_DOC: dict[str, Any] = {"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "SharingPolicy"}
UNCAPPED = {"computePolicy": "off", "priority": -100}


@pytest.mark.parametrize("policy", [shipped_policy(), BUILTIN_DOC], ids=["shipped", "built-in"])
def test_a_claim_cannot_switch_its_own_cap_off_under_the_shipped_policy(
    policy: dict[str, Any],
) -> None:
    """Issue 33 part 4, the attack: allocated `cores: 10`, a claim's own VgpuConfig asked for
    `computePolicy: off, priority: -100` and ran uncapped, served first. Under the shipped policy
    (deploy/base/policy.yaml) and the built-in default prepare now refuses it, naming what is
    allowed; each half alone is refused too."""
    with pytest.raises(ClaimError) as e:
        plan(claim([SHARE], [vgpu_config("FromClaim", **UNCAPPED)]), policy)
    assert str(e.value) == (
        "device gpu-0: config[0] (FromClaim): VgpuConfig computePolicy 'off' is not allowed by "
        "the node's sharing policy (allowedComputePolicies: [hard, elastic]); allowed: hard, "
        "elastic or leave computePolicy out"
    )
    with pytest.raises(ClaimError) as e:
        plan(claim([SHARE], [vgpu_config("FromClaim", priority=-100)]), policy)
    assert str(e.value) == (
        "device gpu-0: config[0] (FromClaim): VgpuConfig priority -100 is higher than the node's "
        "sharing policy allows (highestPriority: 0; lower is served first); allowed: 0..100 or "
        "leave priority out"
    )
    # What the shipped policy does allow: elastic at priority 0 (deploy/examples' claim).
    ok = plan(
        claim([SHARE], [vgpu_config("FromClaim", computePolicy="elastic", priority=0)]), policy
    )
    assert (ok.config.compute_policy, ok.config.priority, ok.devices[0].sm_limit) == (
        "elastic",
        0,
        10,
    )


def test_an_admin_who_lists_off_lets_a_claim_run_uncapped() -> None:
    policy = shipped_policy()
    policy["default"] |= {
        "allowedComputePolicies": ["hard", "elastic", "off"],
        "highestPriority": -100,
    }
    p = plan(claim([SHARE], [vgpu_config("FromClaim", **UNCAPPED)]), policy)
    assert (p.config.compute_policy, p.config.priority) == ("off", -100)
    # An override narrows again for the GPUs it matches (the A100 at index 1 here).
    policy["overrides"] = [{"match": {"modelName": "NVIDIA A100*"}, "allowedComputePolicies": []}]
    on_a100 = dict(SHARE, device="gpu-1")
    with pytest.raises(
        ClaimError, match=r"device gpu-1: .*'off' is not allowed .*allowed: hard or"
    ):
        plan(claim([on_a100], [vgpu_config("FromClaim", computePolicy="off")]), policy)


def test_a_class_may_give_a_priority_a_claim_may_not_ask_for() -> None:
    """DeviceClass configs are the admin's: a class's priority -5 holds, a claim may name it
    again or lower its priority, not raise it further."""
    cls = vgpu_config("FromClass", priority=-5)
    assert plan(claim([SHARE], [cls]), POLICY).config.priority == -5
    again = plan(claim([SHARE], [cls, vgpu_config("FromClaim", priority=-5)]), POLICY)
    assert again.config.priority == -5
    assert (
        plan(claim([SHARE], [cls, vgpu_config("FromClaim", priority=7)]), POLICY).config.priority
        == 7
    )
    with pytest.raises(ClaimError, match=r"priority -6 is higher .* allowed: -5\.\.100"):
        plan(claim([SHARE], [cls, vgpu_config("FromClaim", priority=-6)]), POLICY)


def test_prepare_partition_limits_follow_the_policy() -> None:
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1-slice-1"}
    [limit] = plan(claim([result], []), POLICY, mode="partition").gpu_limits()
    assert (limit.memory_limit, limit.sm_limit) == (18 * GiB, 50)
    beyond = dict(result, device="gpu-1-slice-2")  # the A100 has 2 partitions by policy
    with pytest.raises(ClaimError, match=r"with k in 0\.\.1"):
        plan(claim([beyond], []), POLICY, mode="partition")


def test_whole_gpu_claim_needs_all_cores_and_gets_the_whole_gpu() -> None:
    whole = vgpu_config("FromClass", exclusive=True)
    allocated = dict(SHARE, consumedCapacity={"memory": "4Gi", "cores": "100", "sharers": "1"})
    [limit] = plan(claim([allocated], [whole]), POLICY).gpu_limits()
    assert (limit.memory_limit, limit.sm_limit) == (80 * GiB, 100)
    with pytest.raises(
        ClaimError, match=r'holds 10% of the cores.*allowed: request capacity cores: "100"'
    ):
        plan(claim([SHARE], [whole]), POLICY)


def test_a_gpu_the_reservation_leaves_nothing_of_is_not_published(
    server: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    small = replace(h100(1, memory=3 * GiB), name="NVIDIA T400")
    doc = {**POLICY, "overrides": [{"match": {"modelName": "*T400*"}, "reservedMemory": "2Gi"}]}
    view = PolicyView(from_document(doc))
    p = publisher(server, view, "sharing")
    assert p.publish(inventory([h100(0), small]))
    p.publish(inventory([h100(0), small]))
    assert sorted(devices(server)) == ["gpu-0"]  # 1Gi left: below min 1Gi + step 256Mi
    assert caplog.text.count("leaves nothing to offer") == 1
    p.forget_warnings()  # a reloaded policy: said again, naming the GPU and the numbers
    p.publish(inventory([h100(0), small]))
    assert caplog.text.count("leaves nothing to offer") == 2
    assert (
        f"NVIDIA T400): {3 * GiB} bytes of memory minus the policy's reservedMemory {2 * GiB}"
        in (caplog.text)
    )

"""A pod that asks for `vgpu.sharing.dev/share: 1` (the DeviceClass's extendedResourceName) with no
claim: the scheduler builds a ResourceClaim of its own for it, and the plugin prepares that claim
through the real gRPC sockets like any other.

The claim's shape is the scheduler's (kubernetes/kubernetes, the dynamicresources plugin's
extended-resource claim): generateName `<pod>-extended-resources-`, the annotation
`resource.kubernetes.io/extended-resource-claim: "true"`, the pod as controlling owner, one
request per (container, extended resource) named `container-<i>-request-<j>` (not names a user
wrote, nor an API contract: the plugin must not read meaning into them), ExactCount requests with
no capacity and no claim config. Its results therefore carry the published requestPolicy
defaults as consumed capacity, which is what the container must get.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharing.limitsfile import parse_limits_file
from sharing.policy import Rules, from_document
from tests.driver.kubelet_standin import DRIVER, KIND, NODE, claim_id
from tests.driver.plugin_process import fake_gpus
from tests.driver.plugin_world import PluginWorld

GiB = 1024**3
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
POLICY = from_document(
    {
        "apiVersion": "vgpu.sharing.dev/v1alpha1",
        "kind": "SharingPolicy",
        "default": {
            "memory": {"min": "1Gi", "step": "256Mi", "default": "4Gi"},
            "cores": {"min": 5, "step": 5, "default": 10},
        },
    }
).default


def extended_resource_claim(
    pod: str, requests: list[tuple[str, str]], results: list[dict[str, Any]], cls: str
) -> dict[str, Any]:
    """The claim the scheduler writes for `pod`: requests (name, class) as it names them."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "generateName": f"{pod}-extended-resources-",
            "name": f"{pod}-extended-resources-{uuid.uuid4().hex[:5]}",
            "namespace": "default",
            "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod,
                    "uid": str(uuid.uuid4()),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": name,
                        "exactly": {
                            "deviceClassName": cls,
                            "allocationMode": "ExactCount",
                            "count": 1,
                        },
                    }
                    for name, cls in requests
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {"results": results},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [NODE]}
                            ]
                        }
                    ]
                },
            },
            "reservedFor": [{"resource": "pods", "name": pod, "uid": str(uuid.uuid4())}],
        },
    }


def default_share(rules: Rules, memory_total: int) -> dict[str, str]:
    """What the allocator consumes for a request naming no capacity: every capacity's
    requestPolicy default as the plugin publishes it for this policy."""
    mem = rules.memory.bounds(rules.shareable_memory(memory_total))
    cores = rules.cores.bounds(100)
    assert mem is not None and cores is not None
    return {"memory": str(mem[2]), "cores": str(cores[2]), "sharers": "1"}


class World(PluginWorld):
    def __init__(self, mode: str, partitions: int = 4, policy: Rules = POLICY) -> None:
        super().__init__(mode=mode, partitions=partitions, rules_for=lambda _gpu: policy)

    def limits(self, uid: str) -> dict[str, str]:
        path = self.root / "data" / "claims" / uid / "limits"
        return parse_limits_file(path.read_text())


@pytest.fixture
def sharing() -> Iterator[World]:
    w = World("sharing")
    yield w
    w.close()


@pytest.fixture
def partition() -> Iterator[World]:
    w = World("partition")
    yield w
    w.close()


def test_share_class_names_an_extended_resource_that_is_not_nvidias() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "base" / "deviceclasses.yaml").read_text()))
    names = {d["metadata"]["name"]: d["spec"].get("extendedResourceName") for d in docs}
    assert names == {"vgpu.sharing.dev": "vgpu.sharing.dev/share", "vgpu-whole.sharing.dev": None}
    overlay = yaml.safe_load(
        (DEPLOY / "overlays" / "partition" / "whole-gpu-name.yaml").read_text()
    )
    assert overlay["spec"]["extendedResourceName"] == "vgpu.sharing.dev/gpu"


@pytest.mark.slow
def test_extended_resource_claim_gets_the_policy_default_share(sharing: World) -> None:
    """Two containers each ask for `vgpu.sharing.dev/share: 1`; the scheduler put them on two
    GPUs. Each result consumed the requestPolicy defaults; the plugin answers with the
    scheduler's request names and enforces the defaults."""
    gpus = fake_gpus()
    share = default_share(POLICY, gpus[0].memory_total)
    assert share == {"memory": str(4 * GiB), "cores": "10", "sharers": "1"}
    results = [
        {"request": req, "driver": DRIVER, "pool": NODE, "device": dev,
         "shareID": str(uuid.uuid4()), "consumedCapacity": share}
        for req, dev in (("container-0-request-0", "gpu-0"), ("container-1-request-0", "gpu-1"))
    ]  # fmt: skip
    claim = extended_resource_claim(
        "trainer",
        [
            ("container-0-request-0", "vgpu.sharing.dev"),
            ("container-1-request-0", "vgpu.sharing.dev"),
        ],
        results,
        "vgpu.sharing.dev",
    )
    c = claim_id(sharing.server.put(claim))

    out = sharing.kubelet.prepare([c], "v1")

    assert out[c.uid].error == ""
    got = {(tuple(d.request_names), d.device_name, d.share_id) for d in out[c.uid].devices}
    assert got == {
        (("container-0-request-0",), "gpu-0", results[0]["shareID"]),
        (("container-1-request-0",), "gpu-1", results[1]["shareID"]),
    }
    assert all(d.cdi_device_ids[0] == f"{KIND}={c.uid}" for d in out[c.uid].devices)
    limits = sharing.limits(c.uid)
    for i in (0, 1):
        assert limits[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] == str(4 * GiB)
        assert limits[f"CUDA_DEVICE_SM_LIMIT_{i}"] == "10"
    assert sharing.kubelet.unprepare([c], "v1") == {c.uid: ""}


@pytest.mark.slow
def test_extended_resource_claim_in_partition_mode_gets_one_slice(partition: World) -> None:
    gpu = fake_gpus()[0]
    claim = extended_resource_claim(
        "web",
        [("container-0-request-2", "vgpu.sharing.dev")],  # its third resource, sorted by name
        [{"request": "container-0-request-2", "driver": DRIVER, "pool": NODE,
          "device": "gpu-0-slice-3"}],
        "vgpu.sharing.dev",
    )  # fmt: skip
    c = claim_id(partition.server.put(claim))
    out = partition.kubelet.prepare([c], "v1beta1")
    assert out[c.uid].error == ""
    [d] = out[c.uid].devices
    assert (d.request_names, d.device_name) == (["container-0-request-2"], "gpu-0-slice-3")
    limits = partition.limits(c.uid)
    assert limits["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(POLICY.partition_memory(gpu.memory_total))
    assert limits["CUDA_DEVICE_SM_LIMIT_0"] == str(POLICY.partition_cores())


@pytest.mark.slow
def test_whole_gpu_extended_resource_in_partition_mode() -> None:
    """`vgpu.sharing.dev/gpu: 1` (the partition overlay's name for vgpu-whole.sharing.dev): the
    class's config (VgpuConfig exclusive) reaches the allocation as FromClass with no request
    list, and the GPU the policy leaves whole is the container's, memory and SMs."""
    whole = replace(POLICY, partitions=1)
    w = World("partition", partitions=1, policy=whole)
    try:
        gpu = fake_gpus()[1]
        claim = extended_resource_claim(
            "solver",
            [("container-0-request-0", "vgpu-whole.sharing.dev")],
            [{"request": "container-0-request-0", "driver": DRIVER, "pool": NODE,
              "device": "gpu-1-slice-0"}],
            "vgpu-whole.sharing.dev",
        )  # fmt: skip
        claim["status"]["allocation"]["devices"]["config"] = [
            {
                "source": "FromClass",
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {
                        "apiVersion": "vgpu.sharing.dev/v1alpha1",
                        "kind": "VgpuConfig",
                        "exclusive": True,
                    },
                },
            }
        ]
        c = claim_id(w.server.put(claim))
        out = w.kubelet.prepare([c], "v1")
        assert out[c.uid].error == ""
        limits = w.limits(c.uid)
        assert limits["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(whole.shareable_memory(gpu.memory_total))
        assert limits["CUDA_DEVICE_SM_LIMIT_0"] == "100"
    finally:
        w.close()

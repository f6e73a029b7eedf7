"""The device metadata files (driver/devicemetadata.py, KEP-5304) as the plugin writes them when
the kubelet prepares a claim over the real gRPC sockets: their container paths in the CDI spec,
their content (a stream of DeviceMetadata objects, v1beta1 first) with the attributes this node's
ResourceSlice publishes and the limits the plugin enforces."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdi.schema import validate
from tests.driver.kubelet_standin import (
    DRIVER,
    NODE,
    allocated_claim,
    claim_id,
    result,
)
from tests.driver.plugin_world import PluginWorld

GiB = 1024**3
ROOT = "/var/run/kubernetes.io/dra-device-attributes"
ATTRS: dict[str, dict[str, Any]] = {
    "gpu-0": {"uuid": {"string": "GPU-aaaa"}, "productName": {"string": "NVIDIA H100"},
              "driverVersion": {"version": "550.54.15"},
              "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"}},
    "gpu-1": {"uuid": {"string": "GPU-bbbb"}, "index": {"int": 1}},
}  # fmt: skip


def published_slice() -> dict[str, Any]:
    """This node's pool as a ResourceSlice (attributes are what the plugin copies)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{NODE}-{DRIVER}-0"},
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": n, "attributes": a} for n, a in ATTRS.items()],
        },
    }


class World(PluginWorld):
    def __init__(self) -> None:
        super().__init__()
        self.server.put(published_slice())

    def mounts(self, uid: str) -> dict[str, dict[str, Any]]:
        spec = json.loads((self.root / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json").read_text())
        validate(spec)
        return {m["containerPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}


@pytest.fixture
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


def stream(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a metadata file, in order."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = dec.raw_decode(text, i)
        out.append(obj)
    return out


@pytest.mark.slow
def test_template_claim_gets_one_file_per_request(world: World) -> None:
    claim = allocated_claim(
        "pod1-gpu-x7k2q",
        results=[
            result("train", "gpu-0", memory="4Gi", cores="30"),
            result("infer/small", "gpu-1", memory="2Gi", cores="20"),  # a firstAvailable subrequest
        ],
    )
    claim["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpu"}
    c = claim_id(world.server.put(claim))

    assert world.kubelet.prepare([c])[c.uid].error == ""

    mounts = world.mounts(c.uid)
    claim_dir = world.root / "data" / "claims" / c.uid
    files = {}
    for request in ("train", "infer"):
        path = f"{ROOT}/resourceclaimtemplates/gpu/{request}/{DRIVER}-metadata.json"
        m = mounts.pop(path)
        assert Path(m["hostPath"]) == claim_dir / "metadata" / f"{request}.json"
        assert m["options"][0] == "ro"
        files[request] = stream(Path(m["hostPath"]).read_text())
    assert not [p for p in mounts if p.startswith(ROOT)]

    train_beta, train_alpha = files["train"]
    assert train_beta["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
    assert train_alpha["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"
    assert train_beta["kind"] == train_alpha["kind"] == "DeviceMetadata"
    assert train_beta["metadata"] == {"name": "pod1-gpu-x7k2q", "namespace": "default",
                                      "uid": c.uid, "generation": 1}  # fmt: skip
    assert train_beta["podClaimName"] == "gpu" and "podClaimName" not in train_alpha
    [req] = train_beta["requests"]
    assert req["name"] == "train"
    [dev] = req["devices"]
    assert (dev["driver"], dev["pool"], dev["name"]) == (DRIVER, NODE, "gpu-0")
    assert dev["attributes"] == {
        **ATTRS["gpu-0"],
        "memoryLimit": {"int": 4 * GiB},
        "smLimit": {"int": 30},
        "computePolicy": {"string": "hard"},
        "priority": {"int": 1},
    }
    assert train_alpha["requests"] == train_beta["requests"]
    [infer, _] = files["infer"]
    [req] = infer["requests"]
    assert req["name"] == "infer/small"  # the full reference inside; the path has the top level
    assert req["devices"][0]["attributes"]["uuid"] == {"string": "GPU-bbbb"}
    assert req["devices"][0]["attributes"]["memoryLimit"] == {"int": 2 * GiB}

    assert world.kubelet.unprepare([c]) == {c.uid: ""}
    assert world.plugin.driver.state.trash_idle(60)
    assert not claim_dir.exists()


def test_named_claim_path_and_a_forged_pod_claim_name(world: World) -> None:
    """A claim the pod names directly goes under resourceclaims/<name>; an annotation that is
    not a DNS label (a user can write annotations on a claim they create) is not a path."""
    claim = allocated_claim("shared-gpu", results=[result("gpu", "gpu-0", memory="1Gi")])
    claim["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "../../etc"}
    c = claim_id(world.server.put(claim))
    assert world.kubelet.prepare([c])[c.uid].error == ""
    paths = [p for p in world.mounts(c.uid) if p.startswith(ROOT)]
    assert paths == [f"{ROOT}/resourceclaims/shared-gpu/gpu/{DRIVER}-metadata.json"]


def test_slices_unreadable_fails_the_prepare_with_the_reason(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attributes must be the published ones: without them the prepare fails (the kubelet
    retries) rather than writing a file that says less than the slice."""
    c = claim_id(world.server.put(allocated_claim("c1")))

    def broken(selector: str) -> list[dict[str, Any]]:
        raise ConnectionRefusedError("connection refused")

    with monkeypatch.context() as m:
        m.setattr(world.plugin.driver._kube, "list_slices", broken)
        out = world.kubelet.prepare([c])[c.uid]
    assert out.error.startswith("reading this node's ResourceSlices for the device metadata: ")
    assert world.plugin.claim_dirs() == []
    assert world.kubelet.prepare([c])[c.uid].error == ""  # the slices readable again

"""What the published ResourceSlices say about health and identity: an unhealthy GPU tainted
NoSchedule (key in our domain, cause in the value) where the server keeps taints, left out where
it drops them, the taint gone on recovery; NVIDIA's attribute names in our domain plus the
standard ones, every slice valid against the official resource.k8s.io/v1 schemas (1.34-1.37),
and a selector written for NVIDIA's driver matching ours once its domain is changed."""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from driver.discovery import (
    DiscoveredGpu,
    Discovery,
    Inventory,
    architecture,
    cause_code,
)
from driver.slicebuild import pool_slices
from sharing.observe.nvml_reader import GPU_LOST
from sharing.plan.cel_eval import SelectorEvaluator
from sharing.plan.loader import load_slices
from tests.fakes.apiserver import FakeApiServer, validate_resource_slice
from tests.support.gpu_records import h100, inventory
from tests.support.slice_publishing import DRIVER, NODE, all_devices, publisher, slices

VERSIONS = ("1.34", "1.35", "1.36", "1.37")
TAINT_KEY = f"{DRIVER}/unhealthy"
DOCS = Path(__file__).resolve().parents[2] / "docs"


def taints_of(server: FakeApiServer) -> dict[str, Any]:
    return {d["name"]: d.get("taints") for d in all_devices(server)}


def valid_everywhere(obj: dict[str, Any]) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)
    assert validate_resource_slice(obj) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cause", "value"),
    [
        ("critical XID 79", "xid-79"),
        (GPU_LOST, "gpu-lost"),
        ("NVML unreachable: x", "nvml-unreachable"),
    ],
)
def test_unhealthy_gpu_tainted_with_its_cause_then_untainted(cause: str, value: str) -> None:
    with FakeApiServer(validate_versions=VERSIONS) as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        p = publisher(server, "auto", partitions=2)
        gpus = [h100(0), h100(1)]
        p.publish(inventory(gpus, unhealthy={gpus[1].uuid: cause}))
        taint = {"key": TAINT_KEY, "value": value, "effect": "NoSchedule"}
        assert taints_of(server) == {"gpu-0": None, "gpu-1": [taint]}
        for s in slices(server):
            valid_everywhere(s)
        p.publish(inventory(gpus))
        assert taints_of(server) == {"gpu-0": None, "gpu-1": None}


@pytest.mark.slow
def test_partition_devices_of_an_unhealthy_gpu_are_all_tainted() -> None:
    with FakeApiServer(drop_consumable_capacity=True, validate_versions=VERSIONS) as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        p = publisher(server, "auto", partitions=2)
        gpus = [h100(0), h100(1)]
        p.publish(inventory(gpus, unhealthy={gpus[0].uuid: "critical XID 48"}))
        taint = [{"key": TAINT_KEY, "value": "xid-48", "effect": "NoSchedule"}]
        assert taints_of(server) == {
            "gpu-0-slice-0": taint,
            "gpu-0-slice-1": taint,
            "gpu-1-slice-0": None,
            "gpu-1-slice-1": None,
        }


@pytest.mark.slow
def test_server_without_device_taints_gets_unhealthy_gpus_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="driver.sliceprobe")
    with FakeApiServer(drop_device_taints=True) as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        p = publisher(server, "sharing")
        gpus = [h100(0), h100(1)]
        p.publish(inventory(gpus, unhealthy={gpus[1].uuid: "critical XID 79"}))
        assert taints_of(server) == {"gpu-0": None}
        assert p.probe_.taints is False
        p.publish(inventory(gpus))
        assert taints_of(server) == {"gpu-0": None, "gpu-1": None}
    said = [r for r in caplog.records if "drops device taints" in r.getMessage()]
    assert len(said) == 1


def test_taints_dropped_after_the_probe_leave_the_gpu_out_at_once() -> None:
    """The server changed under the plugin (a downgrade): the write that came back without its
    taint is followed by one that leaves the unhealthy GPU out."""
    with FakeApiServer() as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        p = publisher(server, "sharing")
        gpus = [h100(0), h100(1)]
        p.publish(inventory(gpus))
        assert p.probe_.taints is True
        server.drop_device_taints = True
        p.publish(inventory(gpus, unhealthy={gpus[1].uuid: "critical XID 79"}))
        assert taints_of(server) == {"gpu-0": None}
        assert p.probe_.taints is False


@pytest.mark.slow
def test_a_tainted_pool_has_at_most_64_devices_per_slice() -> None:
    with FakeApiServer() as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        p = publisher(server, "partition", partitions=4)
        gpus = [h100(i) for i in range(20)]  # 80 devices
        p.publish(inventory(gpus))
        assert [len(s["spec"]["devices"]) for s in slices(server)] == [80]
        p.publish(inventory(gpus, unhealthy={gpus[3].uuid: "critical XID 79"}))
        assert [len(s["spec"]["devices"]) for s in slices(server)] == [64, 16]
        for s in slices(server):
            assert validate_resource_slice(s) == []


def test_cause_codes_are_label_values() -> None:
    label_value = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
    for cause in ("critical XID 79", "critical XID 119", GPU_LOST, "NVML unreachable: x", "?"):
        code = cause_code(cause)
        assert label_value.match(code) and len(code) <= 63, code


# --- attributes ------------------------------------------------------------------------------------

NVIDIA_NAMES = {
    "type": "string",
    "uuid": "string",
    "productName": "string",
    "brand": "string",
    "architecture": "string",
    "cudaComputeCapability": "version",
    "driverVersion": "version",
    "cudaDriverVersion": "version",
}
STANDARD = {
    "resource.kubernetes.io/pciBusID": "string",
    "resource.kubernetes.io/pcieRoot": "string",
    "resource.kubernetes.io/numaNode": "int",
}


def _inventory() -> Inventory:
    hopper = h100(0)
    l4 = replace(h100(1), name="NVIDIA L4", compute_capability="8.9", numa_node=1)
    return Inventory(
        (
            DiscoveredGpu(info=hopper, pcie_root="pci0000:17", brand="Nvidia"),
            DiscoveredGpu(info=l4, pcie_root="pci0000:17", brand="Nvidia"),
        )
    )


@pytest.mark.parametrize("mode", ["sharing", "partition"])
def test_attributes_carry_nvidias_names_and_the_standard_ones(mode: str) -> None:
    [s] = pool_slices(_inventory(), mode, 2, DRIVER, NODE, 1)  # type: ignore[arg-type]
    valid_everywhere(s)
    for dev in s["spec"]["devices"]:
        attrs = dev["attributes"]
        for name, kind in {**NVIDIA_NAMES, **STANDARD}.items():
            assert list(attrs[name]) == [kind], (dev["name"], name)
        assert attrs["type"] == {"string": "gpu"}
        assert attrs["index"]["int"] == attrs["minor"]["int"]  # kept, see docs/driver.md
    first, last = s["spec"]["devices"][0]["attributes"], s["spec"]["devices"][-1]["attributes"]
    assert first["architecture"] == {"string": "Hopper"}
    assert last["architecture"] == {"string": "Ada Lovelace"}
    assert first["cudaComputeCapability"] == {"version": "9.0.0"}
    assert first["resource.kubernetes.io/pciBusID"] == {"string": "0000:18:00.0"}
    assert last["resource.kubernetes.io/numaNode"] == {"int": 1}


def test_architecture_by_compute_capability() -> None:
    ccs = ("7.0", "7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
    assert [architecture(cc) for cc in ccs] == [
        "Volta", "Turing", "Ampere", "Ampere", "Ada Lovelace", "Hopper", "Blackwell", "Blackwell",
    ]  # fmt: skip
    assert architecture("x") is None and architecture("2.0") is None


def _doc_selectors() -> tuple[str, str]:
    """The selector docs/driver.md shows for NVIDIA's driver, and the same one for ours."""
    text = (DOCS / "driver.md").read_text()
    found = re.findall(r"```cel\n(.*?)\n```", text, re.S)
    assert len(found) == 2, "docs/driver.md shows the NVIDIA selector and ours as ```cel blocks"
    return found[0].strip(), found[1].strip()


def test_a_selector_written_for_nvidias_driver_ports_by_changing_the_domain(
    tmp_path: Path,
) -> None:
    nvidia, ours = _doc_selectors()
    assert "gpu.nvidia.com" in nvidia
    assert ours == nvidia.replace("gpu.nvidia.com", DRIVER)
    [s] = pool_slices(_inventory(), "sharing", 4, DRIVER, NODE, 1)
    (tmp_path / "slices.yaml").write_text(yaml.safe_dump(s))
    inv, _ = load_slices(tmp_path / "slices.yaml")
    devices = inv.nodes[NODE]
    ev = SelectorEvaluator()
    assert [ev.matches(ev.compile(ours), d) for d in devices] == [True, False]  # H100, not L4
    # the same expression against a device of NVIDIA's driver's shape
    nvidia_shaped = [replace(d, driver="gpu.nvidia.com", attributes={
        k.replace(DRIVER, "gpu.nvidia.com"): v for k, v in d.attributes.items()
    }) for d in devices]  # fmt: skip
    assert [ev.matches(ev.compile(nvidia), d) for d in nvidia_shaped] == [True, False]


def test_the_device_taint_rule_in_the_operations_guide_is_valid_for_1_37() -> None:
    text = (DOCS / "operations.md").read_text()
    docs = [
        yaml.safe_load(block)
        for block in re.findall(r"```yaml\n(.*?)\n```", text, re.S)
        if "kind: DeviceTaintRule" in block
    ]
    assert len(docs) == 1
    [rule] = docs
    kubernetes_validate.validate(rule, "1.37", strict=True)
    assert rule["spec"]["taint"]["effect"] == "NoExecute"
    assert rule["spec"]["deviceSelector"]["driver"] == DRIVER
    assert rule["spec"]["taint"]["key"] == TAINT_KEY
    bad = yaml.safe_load(yaml.safe_dump(rule))
    bad["spec"]["taint"]["efect"] = "NoExecute"  # the check can fail
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37", strict=True)


class BrandedNvml:
    """An NVML that reports brands: counts how often it is asked."""

    def __init__(self, gpus: list[Any]) -> None:
        self.gpus = gpus
        self.asked = 0

    def list_gpus(self) -> list[Any]:
        return list(self.gpus)

    def open_events(self) -> None:
        return None

    def brands(self) -> dict[str, str]:
        self.asked += 1
        return {g.uuid: "Nvidia" for g in self.gpus}


def test_brand_comes_from_nvml_once_per_gpu(tmp_path: Path) -> None:
    nvml = BrandedNvml([h100(0)])
    d = Discovery(nvml, sysfs_root=tmp_path)
    inv = d.inventory(nvml.gpus, {})
    d.inventory(nvml.gpus, {})
    assert [g.brand for g in inv.gpus] == ["Nvidia"] and nvml.asked == 1
    [s] = pool_slices(inv, "sharing", 4, DRIVER, NODE, 1)
    assert s["spec"]["devices"][0]["attributes"]["brand"] == {"string": "Nvidia"}
    nvml.gpus = [h100(0), h100(1)]  # a new GPU: asked again
    assert [g.brand for g in d.inventory(nvml.gpus, {}).gpus] == ["Nvidia", "Nvidia"]
    assert nvml.asked == 2

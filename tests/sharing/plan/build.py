"""Hand-written ResourceSlices and workload files for the `vgpu plan` tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from sharing.cli.main import main

DRIVER = "vgpu.sharing.dev"
CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": DRIVER},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}


def gpu(
    name: str,
    memory: str = "40Gi",
    *,
    shared: bool = True,
    product: str = "NVIDIA A100-SXM4-40GB",
    cc: str = "8.0.0",
    root: str | None = None,
    memory_policy: dict[str, Any] | None = None,
    cores_policy: dict[str, Any] | None = None,
    sharers: int | None = None,
) -> dict[str, Any]:
    """A device as the plugin publishes it (sharing mode unless shared=False)."""
    attrs: dict[str, Any] = {
        "uuid": {"string": f"GPU-{name}"},
        "productName": {"string": product},
        "cudaComputeCapability": {"version": cc},
    }
    if root is not None:
        attrs["resource.kubernetes.io/pcieRoot"] = {"string": root}
    memory_cap: dict[str, Any] = {"value": memory}
    cores: dict[str, Any] = {"value": "100"}
    if memory_policy is not None:
        memory_cap["requestPolicy"] = memory_policy
    if cores_policy is not None:
        cores["requestPolicy"] = cores_policy
    capacity: dict[str, Any] = {"memory": memory_cap, "cores": cores}
    if sharers is not None:
        # What the admin policy publishes: each allocation consumes exactly one.
        capacity["sharers"] = {
            "value": str(sharers),
            "requestPolicy": {"default": "1", "validValues": ["1"]},
        }
    dev: dict[str, Any] = {"name": name, "attributes": attrs, "capacity": capacity}
    if shared:
        dev["allowMultipleAllocations"] = True
    return dev


def resource_slice(
    node: str, devices: list[dict[str, Any]], k: int = 0, count: int = 1
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}-{k}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": count},
            "devices": devices,
        },
    }


def request(
    name: str = "gpu",
    *,
    capacity: dict[str, str] | None = None,
    selectors: list[str] | None = None,
    count: int | None = None,
    mode: str | None = None,
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": DRIVER}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    if count is not None:
        exactly["count"] = count
    if mode is not None:
        exactly["allocationMode"] = mode
    return {"name": name, "exactly": exactly}


def workload(
    name: str,
    replicas: int,
    requests: list[dict[str, Any]],
    constraints: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {"name": name, "replicas": replicas, "spec": {"devices": devices}}


def write_inputs(
    tmp: Path, slices: list[dict[str, Any]], workloads: list[dict[str, Any]]
) -> tuple[Path, Path]:
    s = tmp / "slices.yaml"
    s.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [CLASS, *slices]}))
    w = tmp / "workloads.yaml"
    w.write_text(yaml.safe_dump({"workloads": workloads}))
    return s, w


def run_plan(
    tmp: Path, slices: list[dict[str, Any]], workloads: list[dict[str, Any]], capsys: Any
) -> tuple[int, dict[str, Any]]:
    """`vgpu plan --json` in this process: (exit code, parsed output)."""
    s, w = write_inputs(tmp, slices, workloads)
    code = main(["plan", "--slices", str(s), "--workloads", str(w), "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def placements(doc: dict[str, Any]) -> list[tuple[str, int, str, str, dict[str, str]]]:
    return [
        (p["workload"], p["replica"], p["node"], p["device"], p["consumed"]) for p in doc["placed"]
    ]


def free(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, str]]:
    return {(d["node"], d["device"]): d["free"] for d in doc["devices"]}

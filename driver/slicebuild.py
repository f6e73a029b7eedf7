"""ResourceSlice contents for this node's GPUs: devices, their attributes and capacities, slices.

Pure functions of the inventory and the policy (no API calls): the publisher
(driver/slicepublisher.py), `--dry-run` (driver/dryrun.py) and `vgpu plan`'s worked example use
them.

One pool per node (pool name = node name), slices of at most 128 devices. Modes:
  sharing    each GPU is one device `gpu-<index>` with allowMultipleAllocations and request
             policies on its `memory` and `cores` capacities (consumable capacity, Kubernetes
             1.36+ or the DRAConsumableCapacity gate on);
  partition  each GPU is N fixed devices `gpu-<index>-slice-<k>` with memory/N and 100/N cores,
             for clusters whose API server drops consumable capacity (the 1.34/1.35 default).

Unhealthy GPUs: where the API server keeps device taints (DRADeviceTaints: GA in 1.37, on by
default from 1.36; driver/sliceprobe.py finds out), an unhealthy GPU's devices stay in the slice
with the taint `<driver>/unhealthy=<cause>:NoSchedule` (cause_code(): xid-79, gpu-lost,
nvml-unreachable), removed when it recovers; slices hold at most 64 devices while any is
tainted (128 otherwise). Where the
server drops taints, the devices are left out instead, or the scheduler would keep allocating
the broken GPU. The taint and the kubelet's health stream (health_map) come from the same
Inventory. MIG-enabled GPUs are never offered.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from driver import devicenames
from driver.devicenames import (
    CORES_CAPACITY,
    MEMORY_CAPACITY,
    SHARERS_CAPACITY,
    SHARING,
    Mode,
)
from driver.discovery import DiscoveredGpu, Inventory, architecture, cause_code, semver, sysfs_bdf
from sharing.gpus import GpuInfo
from sharing.kubequantity import to_kubernetes
from sharing.policy import BUILTIN, CORES_TOTAL, Rules

log = logging.getLogger(__name__)

MAX_DEVICES_PER_SLICE = 128
MAX_TAINTED_DEVICES_PER_SLICE = 64  # when any device of the slice may carry taints
MEMORY_MIN = BUILTIN.memory.min
MAX_NAME_LENGTH = 253  # object names are DNS subdomains
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"
PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
NUMA_NODE_ATTRIBUTE = "resource.kubernetes.io/numaNode"
DEVICE_TYPE = "gpu"  # the `type` attribute, as NVIDIA's DRA driver names a full GPU
UNHEALTHY_TAINT = "unhealthy"  # the taint key's name in the driver's domain


def taint_key(driver_name: str) -> str:
    return f"{driver_name}/{UNHEALTHY_TAINT}"


# --- devices ---------------------------------------------------------------------------------------


def _attributes(g: DiscoveredGpu) -> dict[str, Any]:
    """NVIDIA's DRA driver's attribute names (in our domain) plus the standard ones, so that a
    selector written for NVIDIA's driver ports by changing the domain (docs/driver.md)."""
    info = g.info
    attrs: dict[str, Any] = {
        "type": {"string": DEVICE_TYPE},
        "uuid": {"string": info.uuid},
        "index": {"int": info.index},
        "minor": {"int": info.minor},
        "productName": {"string": info.name[:64]},
    }
    if g.brand:
        attrs["brand"] = {"string": g.brand}
    if arch := architecture(info.compute_capability):
        attrs["architecture"] = {"string": arch}
    for key, text in (
        ("cudaComputeCapability", info.compute_capability),
        ("driverVersion", info.driver_version),
        ("cudaDriverVersion", info.cuda_driver_version),
    ):
        version = semver(text)
        if version is None:
            log.warning(
                "GPU %d (%s): %s %r is not a dotted version; left out",
                info.index,
                info.uuid,
                key,
                text,
            )
        else:
            attrs[key] = {"version": version}
    if (bdf := sysfs_bdf(info.pci_bus_id)) is not None:
        attrs[PCI_BUS_ID_ATTRIBUTE] = {"string": bdf[0]}
    if g.pcie_root is not None:
        attrs[PCIE_ROOT_ATTRIBUTE] = {"string": g.pcie_root}
    if info.numa_node is not None and info.numa_node >= 0:
        attrs["numaNode"] = {"int": info.numa_node}
        attrs[NUMA_NODE_ATTRIBUTE] = {"int": info.numa_node}
    return attrs


def _taints(g: DiscoveredGpu, key: str | None) -> list[dict[str, Any]]:
    if g.healthy or key is None:
        return []
    return [{"key": key, "value": cause_code(g.reason), "effect": "NoSchedule"}]


RulesFor = Callable[[GpuInfo], Rules]  # the admin policy's rules of one GPU (driver/policy.py)


def builtin_rules(partitions: int) -> RulesFor:
    """The built-in policy with `partitions`, for every GPU."""
    rules = replace(BUILTIN, partitions=partitions)
    return lambda _info: rules


def sharing_memory_policy(total: int, rules: Rules = BUILTIN) -> dict[str, Any] | None:
    """The memory capacity's requestPolicy: the policy's min and step, max the capacity rounded
    down onto the step grid, default the policy's (or that max).

    (default - min) and (max - min) must be step multiples and min + step <= capacity; a GPU too
    small for that gets no policy (any request up to its memory).
    """
    bounds = rules.memory.bounds(total)
    if bounds is None:
        return None
    lo, hi, default = bounds
    return {
        "default": to_kubernetes(default),
        "validRange": {
            "min": to_kubernetes(lo),
            "max": to_kubernetes(hi),
            "step": to_kubernetes(rules.memory.step),
        },
    }


def sharing_cores_policy(rules: Rules = BUILTIN) -> dict[str, Any]:
    bounds = rules.cores.bounds(CORES_TOTAL)
    assert bounds is not None  # sharing.policy checks that min + step fits in 100
    lo, hi, default = bounds
    return {
        "default": str(default),
        "validRange": {"min": str(lo), "max": str(hi), "step": str(rules.cores.step)},
    }


def sharing_device(g: DiscoveredGpu, rules: Rules = BUILTIN) -> dict[str, Any]:
    shareable = rules.shareable_memory(g.info.memory_total)
    memory: dict[str, Any] = {"value": to_kubernetes(shareable)}
    if (policy := sharing_memory_policy(shareable, rules)) is not None:
        memory["requestPolicy"] = policy
    return {
        "name": devicenames.sharing_name(g.index),
        "allowMultipleAllocations": True,
        "attributes": _attributes(g),
        "capacity": {
            MEMORY_CAPACITY: memory,
            CORES_CAPACITY: {
                "value": str(CORES_TOTAL),
                "requestPolicy": sharing_cores_policy(rules),
            },
            # Every allocation consumes exactly one: a request naming no amount gets the
            # default, and any other amount is above the only valid value (no match).
            SHARERS_CAPACITY: {
                "value": str(rules.max_sharers),
                "requestPolicy": {"default": "1", "validValues": ["1"]},
            },
        },
    }


def partition_devices(
    g: DiscoveredGpu, partitions: int, rules: Rules | None = None
) -> list[dict[str, Any]]:
    rules = rules or replace(BUILTIN, partitions=partitions)
    n = rules.partitions
    devices = []
    for k in range(n):
        attrs = _attributes(g)
        attrs["partition"] = {"int": k}
        attrs["partitionCount"] = {"int": n}
        devices.append(
            {
                "name": devicenames.partition_name(g.index, k),
                "attributes": attrs,
                "capacity": {
                    MEMORY_CAPACITY: {
                        "value": to_kubernetes(rules.partition_memory(g.info.memory_total))
                    },
                    CORES_CAPACITY: {"value": str(rules.partition_cores())},
                },
            }
        )
    return devices


def build_devices(
    gpus: Iterable[DiscoveredGpu],
    mode: Mode,
    partitions: int,
    rules_for: RulesFor | None = None,
    taint: str | None = None,
) -> list[dict[str, Any]]:
    """The devices to offer, in index order, each by its policy rules (rules_for; default: the
    built-in policy with `partitions`). Unhealthy GPUs carry the NoSchedule taint `taint`
    (a key, see taint_key()); with taint None they are left out."""
    rules_of = rules_for or builtin_rules(partitions)
    devices: list[dict[str, Any]] = []
    for g in sorted(gpus, key=lambda g: g.index):
        if g.excluded or (not g.healthy and taint is None):
            continue
        rules = rules_of(g.info)
        if too_small(g.info, mode, rules):
            continue
        devs = (
            [sharing_device(g, rules)]
            if mode == SHARING
            else partition_devices(g, rules.partitions, rules)
        )
        if taints := _taints(g, taint):
            for d in devs:
                d["taints"] = taints
        devices.extend(devs)
    return devices


def too_small(info: GpuInfo, mode: Mode, rules: Rules) -> bool:
    """True when the policy leaves the GPU nothing to offer: its memory after reservedMemory is
    below one memory step above the minimum (sharing) or zero per partition (partition)."""
    shareable = rules.shareable_memory(info.memory_total)
    if mode == SHARING:
        return rules.memory.bounds(shareable) is None
    return rules.partition_memory(info.memory_total) == 0


def too_small_message(node: str, index: int, info: GpuInfo, rules: Rules) -> str:
    """One line naming the GPU and the numbers, for a GPU that too_small() leaves out."""
    return (
        f"node {node}: GPU {index} ({info.uuid}, {info.name}): {info.memory_total} bytes of "
        f"memory minus the policy's reservedMemory {rules.reserved_memory} leaves nothing to "
        f"offer (memory min {rules.memory.min} + step {rules.memory.step}, or "
        f"{rules.partitions} partitions); this GPU is not published"
    )


def too_small_messages(
    inv: Inventory, mode: Mode, node: str, partitions: int, rules_for: RulesFor | None = None
) -> list[str]:
    """too_small_message() for every GPU of inv that the policy leaves out."""
    rules_of = rules_for or builtin_rules(partitions)
    return [
        too_small_message(node, g.index, g.info, rules_of(g.info))
        for g in inv.gpus
        if too_small(g.info, mode, rules_of(g.info))
    ]


def health_map(
    inv: Inventory, mode: Mode, partitions: int, rules_for: RulesFor | None = None
) -> dict[str, str]:
    """Device name -> why it is unhealthy ("" when healthy), for every device of every GPU of
    the inventory: the kubelet's health stream (driver/health.py)."""
    rules_of = rules_for or builtin_rules(partitions)
    return {
        name: "" if g.healthy else (g.reason or "unhealthy")
        for g in inv.gpus
        for name in devicenames.names(g.index, mode, rules_of(g.info).partitions)
    }


def chunk(devices: Sequence[dict[str, Any]], size: int | None = None) -> list[list[dict[str, Any]]]:
    """Devices split into slices of at most `size` (default: 128, or 64 when any device carries
    taints, the API's limits); an empty pool is still one (empty) slice."""
    if not devices:
        return [[]]
    if size is None:
        tainted = any(d.get("taints") for d in devices)
        size = MAX_TAINTED_DEVICES_PER_SLICE if tainted else MAX_DEVICES_PER_SLICE
    return [list(devices[i : i + size]) for i in range(0, len(devices), size)]


# --- slice objects ---------------------------------------------------------------------------------


def slice_name(node_name: str, driver_name: str, k: int) -> str:
    """The name of the k-th ResourceSlice of a node's pool."""
    name = f"{node_name}-{driver_name}-{k}"
    if len(name) <= MAX_NAME_LENGTH:
        return name
    # Long node names: keep the name unique and within the limit with a digest.
    digest = hashlib.sha256(node_name.encode()).hexdigest()[:10]
    return f"{node_name[: MAX_NAME_LENGTH - 80]}-{digest}-{driver_name}-{k}"


def slice_body(
    name: str,
    driver_name: str,
    node_name: str,
    devices: list[dict[str, Any]],
    generation: int,
    slice_count: int,
    owner: list[dict[str, Any]],
) -> dict[str, Any]:
    """One ResourceSlice of the node's pool (pool name = node name) as a JSON object."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name, "ownerReferences": owner} if owner else {"name": name},
        "spec": {
            "driver": driver_name,
            "nodeName": node_name,
            "pool": {
                "name": node_name,
                "generation": generation,
                "resourceSliceCount": slice_count,
            },
            "devices": devices,
        },
    }


def pool_slices(
    inv: Inventory,
    mode: Mode,
    partitions: int,
    driver_name: str,
    node_name: str,
    generation: int,
    rules_for: RulesFor | None = None,
    taints: bool = False,
) -> list[dict[str, Any]]:
    """Every ResourceSlice of the node's pool for this inventory, without owner references
    (taints: unhealthy GPUs tainted rather than left out)."""
    key = taint_key(driver_name) if taints else None
    chunks = chunk(build_devices(inv.gpus, mode, partitions, rules_for, key))
    return [
        slice_body(
            slice_name(node_name, driver_name, k),
            driver_name,
            node_name,
            devs,
            generation,
            len(chunks),
            [],
        )
        for k, devs in enumerate(chunks)
    ]

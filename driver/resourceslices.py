"""Publishing this node's GPUs as ResourceSlices (resource.k8s.io/v1).

One pool per node (pool name = node name), slices of at most 128 devices, owned by the Node.

Modes:
  sharing    each GPU is one device `gpu-<index>` with allowMultipleAllocations and request
             policies on its `memory` and `cores` capacities (consumable capacity, Kubernetes
             1.36+ or the DRAConsumableCapacity gate on);
  partition  each GPU is N fixed devices `gpu-<index>-slice-<k>` with memory/N and 100/N cores,
             for clusters whose API server drops consumable capacity (the 1.34/1.35 default).
In `auto` the publisher writes sharing-mode slices, reads them back and, when the API server
dropped the consumable-capacity fields, warns once and republishes in partition mode.

Unhealthy GPUs are removed from the slices (not tainted): device taints need the
DRADeviceTaints gate, off by default on 1.34/1.35, where the server would silently drop them
and the scheduler would keep allocating the broken GPU.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from driver import devicenames
from driver.backoff import Backoff
from driver.devicenames import (
    CORES_CAPACITY,
    MEMORY_CAPACITY,
    PARTITION,
    SHARERS_CAPACITY,
    SHARING,
    Mode,
    as_mode,
)
from driver.discovery import DiscoveredGpu, Inventory, semver
from driver.kube import ApiException, Kube
from sharing.gpus import GpuInfo
from sharing.kubequantity import to_kubernetes
from sharing.policy import BUILTIN, CORES_TOTAL, Rules

log = logging.getLogger(__name__)

MAX_DEVICES_PER_SLICE = 128
MEMORY_MIN = BUILTIN.memory.min
MAX_NAME_LENGTH = 253  # object names are DNS subdomains
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"


# --- devices ---------------------------------------------------------------------------------------


def _attributes(g: DiscoveredGpu) -> dict[str, Any]:
    info = g.info
    attrs: dict[str, Any] = {
        "uuid": {"string": info.uuid},
        "index": {"int": info.index},
        "minor": {"int": info.minor},
        "productName": {"string": info.name[:64]},
    }
    if g.pcie_root is not None:
        attrs[PCIE_ROOT_ATTRIBUTE] = {"string": g.pcie_root}
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
    if info.numa_node is not None and info.numa_node >= 0:
        attrs["numaNode"] = {"int": info.numa_node}
    return attrs


RulesFor = Callable[[GpuInfo], Rules]  # the admin policy's rules of one GPU (driver/policy.py)


def _builtin(partitions: int) -> RulesFor:
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
) -> list[dict[str, Any]]:
    """The devices to offer: healthy GPUs only, in index order, each by its policy rules
    (rules_for; default: the built-in policy with `partitions`)."""
    rules_of = rules_for or _builtin(partitions)
    devices: list[dict[str, Any]] = []
    for g in sorted(gpus, key=lambda g: g.index):
        if not g.healthy:
            continue
        rules = rules_of(g.info)
        if too_small(g.info, mode, rules):
            continue
        devices.extend(
            [sharing_device(g, rules)]
            if mode == SHARING
            else partition_devices(g, rules.partitions, rules)
        )
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
    rules_of = rules_for or _builtin(partitions)
    return [
        too_small_message(node, g.index, g.info, rules_of(g.info))
        for g in inv.gpus
        if too_small(g.info, mode, rules_of(g.info))
    ]


def health_map(
    inv: Inventory, mode: Mode, partitions: int, rules_for: RulesFor | None = None
) -> dict[str, bool]:
    """Device name -> healthy, for every device of every GPU NVML reports."""
    rules_of = rules_for or _builtin(partitions)
    return {
        name: g.healthy
        for g in inv.gpus
        for name in devicenames.names(g.index, mode, rules_of(g.info).partitions)
    }


def chunk(
    devices: Sequence[dict[str, Any]], size: int = MAX_DEVICES_PER_SLICE
) -> list[list[dict[str, Any]]]:
    """Devices split into slices of at most `size`; an empty pool is still one (empty) slice."""
    if not devices:
        return [[]]
    return [list(devices[i : i + size]) for i in range(0, len(devices), size)]


def consumable_capacity_dropped(
    sent: Sequence[dict[str, Any]], stored: Sequence[dict[str, Any]]
) -> bool:
    """True if the server left out allowMultipleAllocations or a requestPolicy we sent."""
    by_name = {d.get("name"): d for d in stored}
    for dev in sent:
        got = by_name.get(dev["name"]) or {}
        if dev.get("allowMultipleAllocations") and not got.get("allowMultipleAllocations"):
            return True
        for cap_name, cap in (dev.get("capacity") or {}).items():
            if "requestPolicy" in cap and "requestPolicy" not in (
                (got.get("capacity") or {}).get(cap_name) or {}
            ):
                return True
    return False


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
) -> list[dict[str, Any]]:
    """Every ResourceSlice of the node's pool for this inventory, without owner references."""
    chunks = chunk(build_devices(inv.gpus, mode, partitions, rules_for))
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


# --- the publisher ---------------------------------------------------------------------------------


@dataclass
class _Written:
    name: str
    resource_version: str
    devices: list[dict[str, Any]]


class SlicePublisher:
    """Writes the pool of this node; not thread-safe (PublishLoop serialises the calls)."""

    def __init__(
        self,
        kube: Kube,
        *,
        driver_name: str,
        node_name: str,
        requested_mode: str,  # auto | sharing | partition
        partitions: int,
        reprobe_interval: float = 300.0,
        rules_for: RulesFor | None = None,
        on_node_labels: Callable[[dict[str, str]], None] | None = None,
    ) -> None:
        """rules_for: the admin policy's rules per GPU (default: built-in with `partitions`);
        on_node_labels: told the Node's labels before every publish (policy nodeLabels match)."""
        self.kube = kube
        self.rules_for = rules_for
        self.on_node_labels = on_node_labels
        self.driver_name = driver_name
        self.node_name = node_name
        self.requested_mode = requested_mode
        self.partitions = partitions
        self.reprobe_interval = reprobe_interval
        self._mode: Mode | None = as_mode(requested_mode)
        self._server_mode: Mode | None = None
        self._probed_at = 0.0
        self.generation = 0
        self._written: dict[str, _Written] = {}
        self._dropped_warned = False
        self._small_warned: set[tuple[Any, ...]] = set()

    @property
    def mode(self) -> Mode | None:
        """The mode the slices are published in, once decided; fixed for the publisher's life."""
        return self._mode

    @property
    def server_mode(self) -> Mode | None:
        """auto: what the API server supports by the latest probe (None before the first).

        It can differ from `mode` after a cluster upgrade or downgrade; the owner decides what to
        do (the plugin restarts, since the kubelet side reads claims by mode)."""
        return self._server_mode

    def use_mode(self, mode: Mode) -> None:
        """Publish in this mode (decided elsewhere, e.g. remembered from an earlier run)."""
        self._mode = mode

    def _slice_name(self, k: int) -> str:
        return slice_name(self.node_name, self.driver_name, k)

    def _read_node(self) -> dict[str, Any] | None:
        """The Node (None if it does not exist); its labels go to on_node_labels."""
        try:
            node = self.kube.read_node(self.node_name)
        except ApiException as e:
            if e.status != 404:
                raise
            return None
        if self.on_node_labels is not None:
            self.on_node_labels(dict((node.get("metadata") or {}).get("labels") or {}))
        return node

    def _owner(self, node: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The Node as owner. Read at every publish: a Node deleted and re-created has a new
        UID, and slices owned by the old one would be garbage-collected."""
        if node is None:
            log.warning(
                "node %s: Node object not found; publishing ResourceSlices without an owner "
                "reference (they will not be garbage-collected with the Node)",
                self.node_name,
            )
            return []
        uid = str(node["metadata"]["uid"])
        return [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self.node_name,
                "uid": uid,
                "controller": True,
            }
        ]

    def _existing(self) -> dict[str, dict[str, Any]]:
        """Our pool's slices on the server, by name, as JSON dicts."""
        items = self.kube.list_slices(
            f"spec.nodeName={self.node_name},spec.driver={self.driver_name}"
        )
        out: dict[str, dict[str, Any]] = {}
        for d in items:
            if ((d.get("spec") or {}).get("pool") or {}).get("name") == self.node_name:
                out[d["metadata"]["name"]] = d
        return out

    def probe(self) -> Mode:
        """Ask the API server whether it keeps consumable capacity. Raises on API errors.

        The probe is a dry-run create of a slice with one sharing-mode device: the server runs
        it through the same field dropping as a real write and answers with what it would store,
        without any transient sharing-mode devices for the scheduler to allocate.
        """
        probe_device = sharing_device(
            DiscoveredGpu(
                info=GpuInfo(
                    index=0,
                    uuid="GPU-probe",
                    name="probe",
                    memory_total=MEMORY_MIN * 4,
                    memory_used=0,
                    pci_bus_id="0000:00:00.0",
                    minor=0,
                    numa_node=None,
                    compute_capability="0.0",
                    driver_version="0.0",
                    cuda_driver_version="0.0",
                ),
                pcie_root="pci0000:00",
            )
        )
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"generateName": f"{self.node_name}-{self.driver_name}-probe-"},
            "spec": {
                "driver": self.driver_name,
                "nodeName": self.node_name,
                "pool": {"name": self.node_name, "generation": 0, "resourceSliceCount": 1},
                "devices": [probe_device],
            },
        }
        stored = self.kube.create_slice(body, dry_run=True)
        self._probed_at = time.monotonic()
        previous = self._server_mode
        if consumable_capacity_dropped([probe_device], stored["spec"].get("devices") or []):
            if not self._dropped_warned:
                self._dropped_warned = True
                log.warning(
                    "node %s: the API server drops allowMultipleAllocations/requestPolicy from "
                    "ResourceSlices (DRAConsumableCapacity is off: the default before Kubernetes "
                    "1.36); partition mode: each GPU as %d devices gpu-<index>-slice-<k> with "
                    "1/%d of its memory and cores",
                    self.node_name,
                    self.partitions,
                    self.partitions,
                )
            self._server_mode = PARTITION
        else:
            if previous != SHARING:
                log.info(
                    "node %s: the API server keeps consumable capacity: sharing mode",
                    self.node_name,
                )
            self._server_mode = SHARING
        return self._server_mode

    def decide_mode(self) -> Mode:
        """The mode to publish in: explicit, set by use_mode(), or probed once (auto)."""
        if self._mode is None:
            self._mode = self.probe()
        return self._mode

    def publish(self, inv: Inventory) -> bool:
        """Bring the pool in line with inv; True if anything was written. Raises on API errors.

        In auto mode the server is probed again every `reprobe_interval` (see server_mode);
        the publishing mode itself does not change.
        """
        probed_now = self._mode is None
        mode = self.decide_mode()
        stale = time.monotonic() - self._probed_at >= self.reprobe_interval
        if (
            self.requested_mode == "auto"
            and not probed_now
            and (self._server_mode is None or stale)
        ):
            self.probe()
        return self._publish(inv, mode)

    def _publish(self, inv: Inventory, mode: Mode) -> bool:
        node = self._read_node() if self.rules_for is not None else None
        self._warn_too_small(inv, mode)
        devices = build_devices(inv.gpus, mode, self.partitions, self.rules_for)
        chunks = chunk(devices)
        names = [self._slice_name(k) for k in range(len(chunks))]
        existing = self._existing()
        unchanged = (
            self.generation > 0
            and set(existing) == set(names)
            and all(
                n in self._written
                and self._written[n].devices == c
                and existing[n]["metadata"].get("resourceVersion")
                == self._written[n].resource_version
                for n, c in zip(names, chunks, strict=True)
            )
        )
        if unchanged:
            return False
        generation = (
            max(
                [self.generation]
                + [
                    int(((e.get("spec") or {}).get("pool") or {}).get("generation", 0))
                    for e in existing.values()
                ]
            )
            + 1
        )
        owner = self._owner(node if self.rules_for is not None else self._read_node())
        written: dict[str, _Written] = {}
        for name, devs in zip(names, chunks, strict=True):
            body = slice_body(
                name, self.driver_name, self.node_name, devs, generation, len(chunks), owner
            )
            if name in existing:
                body["metadata"]["resourceVersion"] = existing[name]["metadata"]["resourceVersion"]
                resp = self.kube.replace_slice(name, body)
            else:
                resp = self.kube.create_slice(body)
            written[name] = _Written(name, str(resp["metadata"]["resourceVersion"]), devs)
            if mode == SHARING and self.requested_mode == SHARING and not self._dropped_warned:
                stored = (resp.get("spec") or {}).get("devices") or []
                if consumable_capacity_dropped(devs, stored):
                    # Explicit --sharing-mode=sharing on a server without the gate: claims
                    # would get whole GPUs. Say so once; the operator chose this mode.
                    self._dropped_warned = True
                    log.error(
                        "node %s: the API server dropped allowMultipleAllocations/requestPolicy "
                        "from ResourceSlice %s: sharing mode needs DRAConsumableCapacity "
                        "(Kubernetes 1.36+); use --sharing-mode=auto or partition",
                        self.node_name,
                        name,
                    )
        # Leftovers go after the new generation is complete, so the pool is never short.
        for name in sorted(set(existing) - set(names)):
            self.kube.delete_slice(name)
        self._written = written
        self.generation = generation
        log.info(
            "node %s: published %d device(s) in %d ResourceSlice(s), %s mode, pool generation %d",
            self.node_name,
            len(devices),
            len(chunks),
            mode,
            generation,
        )
        return True

    def _warn_too_small(self, inv: Inventory, mode: Mode) -> None:
        rules_of = self.rules_for or _builtin(self.partitions)
        warned = self._small_warned
        for g in inv.gpus:
            rules = rules_of(g.info)
            key = (g.info.uuid, rules.reserved_memory, rules.memory, rules.partitions)
            if too_small(g.info, mode, rules) and key not in warned:
                warned.add(key)
                log.warning("%s", too_small_message(self.node_name, g.index, g.info, rules))

    def forget_warnings(self) -> None:
        """Warn again about GPUs the policy leaves nothing to offer (a reloaded policy)."""
        self._small_warned = set()

    def cleanup(self) -> int:
        """Delete every slice of this node's pool; the number deleted."""
        n = 0
        for name in sorted(self._existing()):
            n += self.kube.delete_slice(name)
        self._written = {}
        log.info("node %s: deleted %d ResourceSlice(s)", self.node_name, n)
        return n


# --- retrying in the background --------------------------------------------------------------------


def describe_error(e: BaseException) -> str:
    """One short line: 'HTTP 503 Service Unavailable', 'NewConnectionError: ... refused'."""
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason or ''}".strip()
    # urllib3's MaxRetryError wraps the real cause in .reason.
    reason = getattr(e, "reason", None)
    if isinstance(reason, BaseException):
        e = reason
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:200]


@dataclass
class PublishLoop:
    """Publishes the latest Inventory from a thread, retrying with backoff while the API fails.

    Also re-checks the pool every `resync` seconds, so a slice someone deleted or changed is
    written again.
    """

    publisher: SlicePublisher
    backoff: Backoff = field(default_factory=Backoff)
    resync: float = 30.0
    on_mode: Callable[[Mode], None] | None = None
    _desired: Inventory | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _stopping: bool = False
    _published: Inventory | None = None
    _healthy_api: bool = True
    _thread: threading.Thread | None = None

    def submit(self, inv: Inventory) -> None:
        with self._cond:
            self._desired = inv
            self._cond.notify_all()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="slice-publisher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def api_reachable(self) -> bool:
        return self._healthy_api

    @property
    def published_once(self) -> bool:
        """True once any Inventory has been published (readiness)."""
        with self._cond:
            return self._published is not None

    def republish(self) -> None:
        """Write the latest Inventory again now (the policy changed what it publishes as)."""
        self.publisher.forget_warnings()
        with self._cond:
            if self._desired is not None:
                self._desired = Inventory(gpus=self._desired.gpus)
            self._cond.notify_all()

    def wait_published(self, timeout: float) -> bool:
        """Until the latest submitted Inventory is on the server (or timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._desired is None or self._published is not self._desired:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def run(self) -> None:
        delays = iter(self.backoff.delays())
        next_resync = time.monotonic() + self.resync
        while True:
            with self._cond:
                while not self._stopping and (
                    self._desired is None
                    or (self._published is self._desired and time.monotonic() < next_resync)
                ):
                    self._cond.wait(
                        max(0.0, next_resync - time.monotonic()) if self._desired else None
                    )
                if self._stopping:
                    return
                inv = self._desired
            assert inv is not None
            try:
                self.publisher.publish(inv)
            except Exception as e:
                delay = next(delays)
                self._healthy_api = False
                log.warning(
                    "node %s: publishing ResourceSlices failed (%s); retrying in %gs",
                    self.publisher.node_name,
                    describe_error(e),
                    delay,
                )
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping, timeout=delay)
                continue
            if not self._healthy_api:
                log.info(
                    "node %s: API server reachable again; ResourceSlices published",
                    self.publisher.node_name,
                )
            self._healthy_api = True
            delays = iter(self.backoff.delays())
            next_resync = time.monotonic() + self.resync
            mode = self.publisher.server_mode or self.publisher.mode
            if mode is not None and self.on_mode is not None:
                self.on_mode(mode)
            with self._cond:
                self._published = inv
                self._cond.notify_all()

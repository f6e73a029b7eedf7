"""Which publishing mode the API server supports: a dry-run write that shows whether it keeps
consumable capacity (allowMultipleAllocations, requestPolicy) and device taints, and the mode
decision.

Device taints (DRADeviceTaints: GA in 1.37, off by default before 1.36) decide how an unhealthy
GPU is published: tainted where the server keeps taints, left out where it drops them
(`taints`). Every mode asks; a real write that comes back without its taints says so too.

In `auto` the publisher writes sharing-mode slices when the server keeps those fields and
partition-mode slices when it drops them (DRAConsumableCapacity off: the default before
Kubernetes 1.36), warning once. The server is probed again every `reprobe_interval`, so a
cluster upgraded or downgraded under a running plugin is noticed (`server_mode`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from driver.devicenames import PARTITION, SHARING, Mode, as_mode
from driver.discovery import DiscoveredGpu
from driver.kube import Kube
from driver.slicebuild import MAX_NAME_LENGTH, MEMORY_MIN, sharing_device, taint_key
from sharing.gpus import GpuInfo

log = logging.getLogger(__name__)


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


def _probe_device(driver_name: str) -> dict[str, Any]:
    """A sharing-mode device of a made-up GPU, large enough for every request policy, tainted."""
    device = sharing_device(
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
    device["taints"] = [{"key": taint_key(driver_name), "value": "probe", "effect": "NoSchedule"}]
    return device


class ModeProbe:
    """Asks the API server which mode it supports; decides the mode once for the plugin's life."""

    def __init__(
        self,
        kube: Kube,
        *,
        driver_name: str,
        node_name: str,
        requested_mode: str,  # auto | sharing | partition
        partitions: int,
        reprobe_interval: float = 300.0,
    ) -> None:
        self.kube = kube
        self.driver_name = driver_name
        self.node_name = node_name
        self.requested_mode = requested_mode
        self.partitions = partitions
        self.reprobe_interval = reprobe_interval
        self.mode: Mode | None = as_mode(requested_mode)
        self.server_mode: Mode | None = None
        self.taints: bool | None = None  # the server keeps device taints (None: not asked yet)
        self._probed_at = 0.0
        self.dropped_warned = False

    def _dry_run(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The probe device, and what the server would store of a slice holding it.

        A dry-run create runs through the same field dropping as a real write and answers
        with what it would store, without any transient devices for the scheduler to allocate.
        Raises on API errors.
        """
        probe_device = _probe_device(self.driver_name)
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"generateName": self._probe_prefix()},
            "spec": {
                "driver": self.driver_name,
                "nodeName": self.node_name,
                "pool": {"name": self.node_name, "generation": 0, "resourceSliceCount": 1},
                "devices": [probe_device],
            },
        }
        stored = self.kube.create_slice(body, dry_run=True)
        self._probed_at = time.monotonic()
        devices: list[dict[str, Any]] = stored["spec"].get("devices") or []
        self._note_taints(bool(devices and devices[0].get("taints")))
        return probe_device, devices

    def _probe_prefix(self) -> str:
        """generateName of the probe: <node>-<driver>-probe-, shortened (by a digest of the node
        name) where the server's 5 random characters would take it past 253."""
        prefix = f"{self.node_name}-{self.driver_name}-probe-"
        if len(prefix) <= MAX_NAME_LENGTH - 5:
            return prefix
        digest = hashlib.sha256(self.node_name.encode()).hexdigest()[:10]
        return f"{digest}-{self.driver_name}-probe-"

    def _note_taints(self, kept: bool) -> None:
        if kept != self.taints:
            if kept:
                log.info(
                    "node %s: the API server keeps device taints: an unhealthy GPU is tainted "
                    "%s:NoSchedule",
                    self.node_name,
                    taint_key(self.driver_name),
                )
            else:
                log.warning(
                    "node %s: the API server drops device taints (DRADeviceTaints is off: the "
                    "default before Kubernetes 1.36); an unhealthy GPU is left out of the "
                    "ResourceSlices instead",
                    self.node_name,
                )
        self.taints = kept

    def probe(self) -> Mode:
        """Ask the API server whether it keeps consumable capacity (and device taints)."""
        probe_device, stored = self._dry_run()
        previous = self.server_mode
        if consumable_capacity_dropped([probe_device], stored):
            if not self.dropped_warned:
                self.dropped_warned = True
                log.warning(
                    "node %s: the API server drops allowMultipleAllocations/requestPolicy from "
                    "ResourceSlices (DRAConsumableCapacity is off: the default before Kubernetes "
                    "1.36); partition mode: each GPU as %d devices gpu-<index>-slice-<k> with "
                    "1/%d of its memory and cores",
                    self.node_name,
                    self.partitions,
                    self.partitions,
                )
            self.server_mode = PARTITION
        else:
            if previous != SHARING:
                log.info(
                    "node %s: the API server keeps consumable capacity: sharing mode",
                    self.node_name,
                )
            self.server_mode = SHARING
        return self.server_mode

    def decide(self) -> Mode:
        """The mode to publish in: explicit, set from outside, or probed once (auto)."""
        if self.mode is None:
            self.mode = self.probe()
        return self.mode

    def for_publish(self) -> Mode:
        """decide(), and a new probe every `reprobe_interval` (auto: see server_mode; an explicit
        mode asks about taints only); the publishing mode itself does not change."""
        probed_now = self.mode is None
        mode = self.decide()
        stale = time.monotonic() - self._probed_at >= self.reprobe_interval
        if self.requested_mode == "auto":
            if not probed_now and (self.server_mode is None or stale):
                self.probe()
        elif self.taints is None or stale:
            self._dry_run()
        return mode

    def note_stored(
        self, slice_name: str, sent: list[dict[str, Any]], resp: dict[str, Any]
    ) -> None:
        """After a real write: taints that did not stick (the server changed since the probe)
        mean unhealthy GPUs must be left out; an explicit --sharing-mode=sharing on a server
        without the consumable-capacity gate gives claims whole GPUs (said once; the operator
        chose this mode)."""
        stored = (resp.get("spec") or {}).get("devices") or []
        if any(d.get("taints") for d in sent) and not any(d.get("taints") for d in stored):
            self._note_taints(False)
        if self.mode != SHARING or self.requested_mode != SHARING or self.dropped_warned:
            return
        if consumable_capacity_dropped(sent, stored):
            self.dropped_warned = True
            log.error(
                "node %s: the API server dropped allowMultipleAllocations/requestPolicy "
                "from ResourceSlice %s: sharing mode needs DRAConsumableCapacity "
                "(Kubernetes 1.36+); use --sharing-mode=auto or partition",
                self.node_name,
                slice_name,
            )

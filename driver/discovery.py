"""GPU discovery for the DRA driver: what NVML reports, the PCIe root from sysfs, and health.

Health: a GPU is unhealthy while it delivers critical XID events (nvmlEventTypeXidCriticalError,
minus the XIDs that mean an application fault, as NVIDIA's device plugin does). Every
rediscovery round registers a fresh event set (the simulator, like a GPU that keeps failing,
delivers the error to it again) and then waits on it for the rest of the interval, so a new
error is noticed at once. An error seen while waiting keeps the GPU unhealthy through the next
round too; a GPU recovers after a whole round without a critical XID. A GPU that NVML stops
reporting is lost: it stays in the inventory, unhealthy, until NVML reports it again (unless
another GPU took its index). While NVML itself does not answer, every GPU it reported is
unhealthy. Where NVML has no events (some vGPU/MIG setups), health is presence only, logged once.

The cause of each unhealthy GPU is one of xid_cause(n), GPU_LOST, nvml_cause(error) or
MIG_REASON; cause_code() turns it into the short form a device taint's value carries.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sharing.gpus import GpuInfo, list_gpus
from sharing.observe.nvml_reader import GPU_LOST

log = logging.getLogger(__name__)

# XIDs caused by the application, not the GPU (the list NVIDIA's k8s device plugin skips):
# 13 graphics engine exception, 31 memory page fault, 43 stopped channel, 45 preemptive
# cleanup, 68 video processor exception, 109 context switch timeout.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

MIG_REASON = "MIG mode enabled (not supported yet)"
_NVML_UNREACHABLE = "NVML unreachable"


def xid_cause(xid: int) -> str:
    return f"critical XID {xid}"


def nvml_cause(error: object) -> str:
    return f"{_NVML_UNREACHABLE}: {error}"


def cause_code(cause: str) -> str:
    """The cause as a label value (a device taint's value): xid-79, gpu-lost, nvml-unreachable,
    mig-enabled; "unhealthy" for anything else."""
    if m := re.fullmatch(r"critical XID (\d+)", cause):
        return f"xid-{m.group(1)}"
    if cause == GPU_LOST:
        return "gpu-lost"
    if cause.startswith(_NVML_UNREACHABLE):
        return "nvml-unreachable"
    if cause == MIG_REASON:
        return "mig-enabled"
    return "unhealthy"


_PCI_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


@dataclass(frozen=True)
class XidEvent:
    uuid: str
    xid: int


class EventSource(Protocol):
    """An NVML event set registered for critical XIDs on every GPU."""

    def wait(self, timeout: float) -> list[XidEvent]:
        """Events that arrive within timeout seconds (all already pending, at least)."""
        ...

    def close(self) -> None: ...


class NvmlBackend(Protocol):
    """The part of NVML discovery uses; the real one is PynvmlBackend."""

    def list_gpus(self) -> list[GpuInfo]: ...

    def open_events(self) -> EventSource | None:
        """A registered event set, or None where NVML offers no XID events."""
        ...


# nvmlBrandType as NVIDIA's DRA driver spells it in its `brand` attribute (go-nvlib's names).
BRANDS = (
    "Unknown", "Quadro", "Tesla", "NVS", "Grid", "GeForce", "Titan", "NvidiaVApps", "NvidiaVPC",
    "NvidiaVCS", "NvidiaVWS", "NvidiaCloudGaming", "QuadroRTX", "NvidiaRTX", "Nvidia",
    "GeForceRTX", "TitanRTX",
)  # fmt: skip

# CUDA compute capability (major, minor) -> architecture, as NVIDIA's DRA driver names them.
_ARCHITECTURES = {
    3: "Kepler", 5: "Maxwell", 6: "Pascal", 7: "Volta", 8: "Ampere", 9: "Hopper",
    10: "Blackwell", 11: "Blackwell", 12: "Blackwell",
}  # fmt: skip


def architecture(compute_capability: str) -> str | None:
    """The GPU architecture of a compute capability ('8.9' -> 'Ada Lovelace'); None if unknown.
    The capability determines it, so no NVML call (nvmlDeviceGetArchitecture) is needed."""
    try:
        major, minor = (int(p) for p in compute_capability.split("."))
    except ValueError:
        return None
    if (major, minor) == (7, 5):
        return "Turing"
    if (major, minor) == (8, 9):
        return "Ada Lovelace"
    return _ARCHITECTURES.get(major)


class PynvmlBackend:
    """NVML through pynvml (libnvidia-ml.so.1: the real one on a GPU node, or the simulator)."""

    def list_gpus(self) -> list[GpuInfo]:
        return list_gpus()

    def brands(self) -> dict[str, str]:
        """UUID -> product brand (nvmlDeviceGetBrand); GPUs whose NVML lacks it are left out."""
        import pynvml

        out: dict[str, str] = {}
        pynvml.nvmlInit()
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                try:
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    brand = int(pynvml.nvmlDeviceGetBrand(h))
                    uuid = pynvml.nvmlDeviceGetUUID(h)
                except pynvml.NVMLError as e:
                    log.debug("GPU %d: no brand: %s", i, e)
                    continue
                if 0 < brand < len(BRANDS):
                    out[uuid.decode() if isinstance(uuid, bytes) else str(uuid)] = BRANDS[brand]
        finally:
            pynvml.nvmlShutdown()
        return out

    def open_events(self) -> EventSource | None:
        import pynvml

        pynvml.nvmlInit()
        try:
            es = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            pynvml.nvmlShutdown()
            log.debug("nvmlEventSetCreate failed: %s", e)
            return None
        registered = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
                registered += 1
            except pynvml.NVMLError as e:
                log.debug("GPU %d: no XID events: %s", i, e)
        if registered == 0:
            pynvml.nvmlEventSetFree(es)
            pynvml.nvmlShutdown()
            return None
        return _PynvmlEvents(es)


class _PynvmlEvents:
    def __init__(self, es: Any) -> None:
        self._es = es

    def wait(self, timeout: float) -> list[XidEvent]:
        import pynvml

        events: list[XidEvent] = []
        ms = max(0, int(timeout * 1000))
        while True:
            try:
                data = pynvml.nvmlEventSetWait_v2(self._es, ms)
            except pynvml.NVMLError_Timeout:
                return events
            ms = 0  # drain what else is pending without waiting again
            try:
                uuid = pynvml.nvmlDeviceGetUUID(data.device)
            except pynvml.NVMLError:
                continue
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            events.append(XidEvent(uuid=uuid, xid=int(data.eventData)))

    def close(self) -> None:
        import pynvml

        try:
            pynvml.nvmlEventSetFree(self._es)
        finally:
            pynvml.nvmlShutdown()


def semver(text: str) -> str | None:
    """NVML's dotted versions as semver: '9.0' -> '9.0.0', '535.104.05' -> '535.104.5'.

    Leading zeros are not allowed in semver numbers, and real driver versions have them
    ('470.82.01'); parts beyond the third become build metadata. None if not dotted numbers.
    """
    parts = text.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        return None
    nums = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    core = ".".join(nums[:3])
    return f"{core}+{'.'.join(parts[3:])}" if len(parts) > 3 else core


def sysfs_bdf(bus_id: str) -> tuple[str, int, int] | None:
    """NVML's bus id ('00000000:3B:00.0') as sysfs names it ('0000:3b:00.0'), domain, bus."""
    m = _BUS_ID.match(bus_id.strip())
    if not m:
        return None
    domain = int(m.group(1) or "0", 16)
    bus, dev, fn = int(m.group(2), 16), int(m.group(3), 16), int(m.group(4))
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}", domain, bus


@dataclass(frozen=True)
class DiscoveredGpu:
    info: GpuInfo
    pcie_root: str | None  # None: unknown, attribute left out
    healthy: bool = True
    reason: str = ""  # why it is unhealthy
    brand: str | None = None  # NVML's product brand, where it reports one

    @property
    def excluded(self) -> bool:
        """Not offered at all, even tainted: MIG mode (not a health problem of the GPU)."""
        return self.reason == MIG_REASON

    @property
    def index(self) -> int:
        return self.info.index


@dataclass(frozen=True)
class Inventory:
    """What one rediscovery round found (every GPU NVML reports, healthy or not)."""

    gpus: tuple[DiscoveredGpu, ...]

    def healthy(self) -> list[DiscoveredGpu]:
        return [g for g in self.gpus if g.healthy]

    def infos(self) -> list[GpuInfo]:
        return [g.info for g in self.gpus]


class Discovery:
    """Turns NVML's GPUs into DiscoveredGpus (PCIe root from sysfs, health from XID events)."""

    def __init__(self, backend: NvmlBackend, *, sysfs_root: Path = Path("/sys")) -> None:
        self.backend = backend
        self.sysfs_root = sysfs_root
        self._fallback_logged = False
        self._mig_logged: set[str] = set()
        self._brands: dict[str, str] = {}  # by UUID; a GPU's brand does not change
        self._brand_asked: set[str] = set()

    def pcie_root(self, gpu: GpuInfo) -> str | None:
        """The PCIe root complex ('pci0000:00') the GPU hangs off, for resource.kubernetes.io/pcieRoot.

        sysfs links /sys/bus/pci/devices/<bdf> into /sys/devices/pci<domain>:<bus>/...; the
        first path component of that form is the root complex. Where sysfs lacks the device
        (containers without /sys, simulated GPUs), 'pci<domain>:<bus>' of the GPU's own bus id
        stands in: distinct per bus, but not the root; logged once. None (attribute left out,
        logged) for a bus id that is not one.
        """
        parsed = sysfs_bdf(gpu.pci_bus_id)
        if parsed is None:
            log.warning(
                "GPU %d (%s): PCI bus id %r is not domain:bus:device.function; "
                "resource.kubernetes.io/pcieRoot left out",
                gpu.index,
                gpu.uuid,
                gpu.pci_bus_id,
            )
            return None
        bdf, domain, bus = parsed
        link = self.sysfs_root / "bus" / "pci" / "devices" / bdf
        if link.exists():
            for part in Path(os.path.realpath(link)).parts:
                if _PCI_ROOT.match(part):
                    return part
        fallback = f"pci{domain:04x}:{bus:02x}"
        if not self._fallback_logged:
            self._fallback_logged = True
            log.warning(
                "GPU %d (%s): %s has no PCI root in sysfs; using %s (the GPU's own bus) as "
                "resource.kubernetes.io/pcieRoot (logged once; other GPUs likewise)",
                gpu.index,
                gpu.uuid,
                link,
                fallback,
            )
        return fallback

    def _learn_brands(self, gpus: Sequence[GpuInfo]) -> None:
        brands = getattr(self.backend, "brands", None)
        if brands is None or all(g.uuid in self._brand_asked for g in gpus):
            return
        try:
            self._brands.update(brands())
        except Exception as e:  # NVML down: the brand is looked up again next round
            log.debug("NVML brands: %s", e)
            return
        self._brand_asked.update(g.uuid for g in gpus)

    def inventory(self, gpus: Sequence[GpuInfo], unhealthy: dict[str, str]) -> Inventory:
        """A MIG-enabled GPU is left out of the offer like an unhealthy one: its memory and SMs
        belong to MIG instances, which the shim cannot share (MIG is not supported yet)."""
        excluded = dict(unhealthy)
        for g in gpus:
            if g.mig_enabled:
                excluded.setdefault(g.uuid, MIG_REASON)
                if g.uuid not in self._mig_logged:
                    self._mig_logged.add(g.uuid)
                    log.warning(
                        "GPU %d (%s): MIG mode is enabled; not offered (MIG is not supported "
                        "yet: disable MIG with nvidia-smi -i %d -mig 0, or leave the GPU to "
                        "NVIDIA's MIG-aware plugins)",
                        g.index,
                        g.uuid,
                        g.index,
                    )
        self._learn_brands(gpus)
        return Inventory(
            tuple(
                DiscoveredGpu(
                    info=g,
                    pcie_root=self.pcie_root(g),
                    healthy=g.uuid not in excluded,
                    reason=excluded.get(g.uuid, ""),
                    brand=self._brands.get(g.uuid),
                )
                for g in sorted(gpus, key=lambda g: g.index)
            )
        )


@dataclass
class Rediscovery:
    """The rediscovery loop: every `interval` seconds, and at once on a critical XID.

    on_change gets each Inventory that differs from the previous one (and the first).
    """

    discovery: Discovery
    interval: float
    on_change: Callable[[Inventory], None]
    stop_event: threading.Event = field(default_factory=threading.Event)
    _last: Inventory | None = None
    _events_unavailable_logged: bool = False
    _last_gpus: list[GpuInfo] = field(default_factory=list)
    _seen: dict[str, GpuInfo] = field(default_factory=dict)  # every GPU NVML reported, by UUID

    def round(self, carried: dict[str, str]) -> tuple[dict[str, str], EventSource | None]:
        """One discovery pass; returns the unhealthy map and the open event set (if any)."""
        unhealthy = dict(carried)
        try:
            gpus = self._with_lost(self.discovery.backend.list_gpus(), unhealthy)
            self._last_gpus = gpus
        except Exception as e:  # NVML gone (driver unloaded, hung): nothing it knew is usable
            log.error("NVML discovery failed: %s; marking every known GPU unhealthy", e)
            gpus = self._last_gpus
            for g in gpus:
                unhealthy[g.uuid] = nvml_cause(e)
            self._emit(self.discovery.inventory(gpus, unhealthy))
            return unhealthy, None
        events = None
        try:
            events = self.discovery.backend.open_events()
        except Exception as e:
            log.warning("NVML events failed: %s", e)
        if events is None and not self._events_unavailable_logged:
            self._events_unavailable_logged = True
            log.warning("NVML XID events unavailable: GPU health is presence only")
        try:
            if events is not None:
                self._note(events.wait(0.05), unhealthy, gpus)
            self._emit(self.discovery.inventory(gpus, unhealthy))
        except BaseException:
            if events is not None:
                events.close()
            raise
        return unhealthy, events

    def run(self) -> None:
        carried: dict[str, str] = {}
        while not self.stop_event.is_set():
            try:
                unhealthy, events = self.round(carried)
            except Exception:
                # A bug or an NVML surprise must not end health monitoring for good.
                log.exception("rediscovery round failed; trying again in %gs", self.interval)
                self.stop_event.wait(self.interval)
                continue
            carried = {}
            deadline = time.monotonic() + self.interval
            try:
                while not self.stop_event.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if events is None:
                        self.stop_event.wait(left)
                        continue
                    fresh: dict[str, str] = {}
                    self._note(events.wait(min(0.5, left)), fresh, self._last_gpus)
                    if fresh:
                        carried.update(fresh)
                        if any(u not in unhealthy for u in fresh):
                            unhealthy.update(fresh)
                            self._emit(self.discovery.inventory(self._last_gpus, unhealthy))
            finally:
                if events is not None:
                    events.close()

    def _with_lost(self, gpus: list[GpuInfo], unhealthy: dict[str, str]) -> list[GpuInfo]:
        """gpus plus every GPU seen before that NVML no longer reports (marked GPU_LOST in
        unhealthy), unless a reported GPU has its index now (device names are by index)."""
        present = {g.uuid for g in gpus}
        taken = {g.index for g in gpus}
        out = list(gpus)
        for uuid, old in sorted(self._seen.items(), key=lambda kv: kv[1].index):
            if uuid in present:
                continue
            if old.index in taken:
                log.warning(
                    "GPU %d (%s) is gone and another GPU has its index; no longer reported",
                    old.index,
                    uuid,
                )
                del self._seen[uuid]
                continue
            unhealthy[uuid] = GPU_LOST
            taken.add(old.index)
            out.append(old)
        for g in gpus:
            self._seen[g.uuid] = g
        return out

    def _note(self, events: list[XidEvent], into: dict[str, str], gpus: Sequence[GpuInfo]) -> None:
        index = {g.uuid: g.index for g in gpus}
        for ev in events:
            if ev.xid in APPLICATION_XIDS:
                log.info("GPU %s: XID %d (application error), health unchanged", ev.uuid, ev.xid)
                continue
            if ev.uuid not in into:
                log.warning(
                    "GPU %s (%s): critical XID %d: unhealthy",
                    index.get(ev.uuid, "?"),
                    ev.uuid,
                    ev.xid,
                )
            into[ev.uuid] = xid_cause(ev.xid)

    def _emit(self, inv: Inventory) -> None:
        if inv == self._last:
            return
        self.on_change(inv)  # if it raises, the next round offers the same inventory again
        previous, self._last = self._last, inv
        if previous is not None:
            _log_changes(previous, inv)


def _log_changes(old: Inventory, new: Inventory) -> None:
    before = {g.info.uuid: g for g in old.gpus}
    after = {g.info.uuid: g for g in new.gpus}
    for uuid in before.keys() - after.keys():
        log.warning("GPU %d (%s) is gone", before[uuid].index, uuid)
    for uuid in after.keys() - before.keys():
        log.info("GPU %d (%s) appeared", after[uuid].index, uuid)
    for uuid in before.keys() & after.keys():
        b, a = before[uuid], after[uuid]
        if b.healthy != a.healthy:
            if a.healthy:
                log.info("GPU %d (%s) is healthy again", a.index, uuid)
            else:
                log.warning("GPU %d (%s) is unhealthy: %s", a.index, uuid, a.reason)

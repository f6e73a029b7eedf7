"""What the node's GPUs and slices look like now: the one model behind the exporter's metrics,
`vgpu top` and the watchdog. Built from the slices' accounting files (read at every call) and
the newest NVML reading (made by the poller thread, never waited for).

A slice's accounting file is its tenant's to write. A file that cannot be read as this layout
(truncated, grown, overwritten header) makes that slice *unreadable*: listed in
NodeView.unreadable with the reason, logged once, and left out of the figures; the other slices
are served. Figures the file claims that no slice can hold (memory used or peak above the
device's memory, as NVML last reported it) are clamped to the device's memory and the slice is
marked *untrusted* on that device, so one tenant's 2^64-1 never reaches node-wide sums.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from sharing import region
from sharing.counters import CounterReader, DeviceCounters, SliceCounters
from sharing.observe.nvml_reader import GpuReading, NvmlReading
from sharing.observe.procinfo import Container
from sharing.observe.slices import Slice, SliceFinder, slice_limits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContainerMemory:
    container: Container
    used_bytes: int  # NVML's memory of the container's processes on the device
    processes: int


class ContainerLookup(Protocol):
    """The memory by container of the last NVML pass (sharing/observe/containers.py)."""

    def get(self, key: str, device: int) -> tuple[ContainerMemory, ...]: ...


RATE_MIN_WINDOW = 1.0  # seconds: compute_used_ratio is measured over at least this


@dataclass(frozen=True)
class SliceDeviceView:
    slice: Slice
    device: int  # index inside the slice
    counters: DeviceCounters
    memory_limit: int
    compute_limit_ratio: float
    compute_used_ratio: float
    processes: int  # live processes of the slice (all its devices)
    violations: int  # watchdog findings so far
    without_shim: int = 0  # watchdog: the slice's GPU processes there that run without the shim
    untrusted: bool = False  # its counters claimed the impossible here and were clamped
    # the memory its containers hold there, as the last NVML pass saw it (sharing/observe/containers.py)
    containers: tuple[ContainerMemory, ...] = ()
    # bursting (docs/policy.md): the limit above memory_limit (then the request), 0 = none
    memory_burst_limit: int = 0

    @property
    def memory_bound(self) -> int:
        """The most the slice may ever hold there: its limit while it bursts, else its quota."""
        return self.memory_burst_limit or self.memory_limit

    @property
    def memory_borrowed(self) -> int:
        """Bytes the slice uses above its request (borrowed from the device's pool), 0 unless it
        bursts."""
        if not self.memory_burst_limit:
            return 0
        return max(0, self.counters.used - self.memory_limit)


@dataclass(frozen=True)
class DeviceView:
    gpu: GpuReading
    slices: tuple[SliceDeviceView, ...]
    unattributed_violations: int  # watchdog: GPU processes of no slice on this shared GPU

    @property
    def memory_allocated(self) -> int:
        return sum(s.memory_limit for s in self.slices)

    @property
    def cores_allocated_ratio(self) -> float:
        return sum(s.compute_limit_ratio for s in self.slices)


@dataclass(frozen=True)
class UnreadableSlice:
    """A slice whose accounting file could not be read as this layout at this look."""

    slice: Slice
    reason: str  # one line naming the file and what is wrong
    gpus: tuple[GpuReading, ...]  # its GPUs as far as known (from its CDI spec), for labels


@dataclass(frozen=True)
class NodeView:
    devices: tuple[DeviceView, ...]
    errors: tuple[str, ...]  # one line per slice that could not be read, NVML trouble
    counters: dict[str, SliceCounters]  # by slice key: for the watchdog
    # (slice key, device) -> (now_ns, charged_ns) this view's shares were measured at
    samples: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    unreadable: tuple[UnreadableSlice, ...] = ()


class RateTracker:
    """Achieved compute share from charged device time: d(charged_ns) / d(wall ns) against the
    newest sample at least RATE_MIN_WINDOW old (with one scraper: exactly its last interval)."""

    def __init__(self) -> None:
        self._hist: dict[tuple[str, int], deque[tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def ratio(self, key: tuple[str, int], charged_ns: int, now_ns: int) -> float:
        """The share since the base sample (add() records samples)."""
        with self._lock:
            h = self._hist.get(key)
            base = None
            if h:
                for i in range(len(h) - 1, -1, -1):
                    if now_ns - h[i][0] >= RATE_MIN_WINDOW * 1e9:
                        base = h[i]
                        for _ in range(i):  # older samples are never a base again
                            h.popleft()
                        break
                if base is None:
                    base = h[0]
        if base is None or now_ns <= base[0]:
            return 0.0
        # at most the whole device: charged time beyond wall time is the tenant's word only
        return min(1.0, max(0.0, (charged_ns - base[1]) / (now_ns - base[0])))

    def add(self, samples: dict[tuple[str, int], tuple[int, int]]) -> None:
        """Record (now_ns, charged_ns) samples: the bases of later ratios."""
        with self._lock:
            for key, sample in samples.items():
                h = self._hist.setdefault(key, deque())
                if not h or sample[0] > h[-1][0]:
                    h.append(sample)

    def forget_except(self, keys: set[str]) -> None:
        with self._lock:
            for k in [k for k in self._hist if k[0] not in keys]:
                del self._hist[k]


class ViolationCounts:
    """The watchdog's findings, read by the view (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slice: dict[tuple[str, int], int] = {}
        self._unattributed: dict[str, int] = {}  # by GPU UUID
        self._without_shim: dict[tuple[str, int], int] = {}  # as of the last pass

    def add_slice(self, key: str, device: int) -> None:
        with self._lock:
            self._slice[(key, device)] = self._slice.get((key, device), 0) + 1

    def add_unattributed(self, uuid: str) -> None:
        with self._lock:
            self._unattributed[uuid] = self._unattributed.get(uuid, 0) + 1

    def set_without_shim(self, counts: dict[tuple[str, int], int]) -> None:
        """Replace the counts of processes without the shim (the watchdog's last pass)."""
        with self._lock:
            self._without_shim = dict(counts)

    def without_shim(self, key: str, device: int) -> int:
        with self._lock:
            return self._without_shim.get((key, device), 0)

    def slice(self, key: str, device: int) -> int:
        with self._lock:
            return self._slice.get((key, device), 0)

    def unattributed(self, uuid: str) -> int:
        with self._lock:
            return self._unattributed.get(uuid, 0)


class LineLog:
    """Logs one line per trouble while it lasts, across the builders that share it (the
    exporter's scrape and watchdog builders see the same unreadable slice: one line). A trouble
    is keyed by what it is about (a slice's key, else the line itself): a tenant whose file
    changes from one bad size to another does not get a line per look."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_owner: dict[int, set[str]] = {}

    def report(self, owner: object, troubles: list[tuple[str, str]]) -> None:
        """`owner`'s current (key, line) troubles; a key no owner reported at its last call is
        logged with its line."""
        with self._lock:
            seen: set[str] = set().union(*self._by_owner.values())
            self._by_owner[id(owner)] = {k for k, _ in troubles}
        for key, line in dict(troubles).items():
            if key not in seen:
                log.warning("%s", line)


def _placeholder_gpu(uuid: str, index: int) -> GpuReading:
    """A slice's GPU NVML does not (or not yet) report."""
    return GpuReading(index=index, uuid=uuid, name="", pci_bus_id="", healthy=False)


class ViewBuilder:
    def __init__(
        self,
        finder: SliceFinder,
        latest: Any,  # Callable[[], NvmlReading]
        violations: ViolationCounts | None = None,
        lines: LineLog | None = None,
        containers: ContainerLookup | None = None,
    ) -> None:
        self.finder = finder
        self.containers = containers
        self.latest = latest
        self.violations = violations or ViolationCounts()
        self.rates = RateTracker()
        self._lock = threading.Lock()  # SliceFinder is not thread-safe
        self._lines = lines or LineLog()  # errors logged once each while they last
        self._reader = CounterReader()  # guarded by _lock
        # device memory by GPU UUID as NVML last reported it: the bound of a slice's figures
        # while NVML is briefly unreadable (a GPU's memory does not change)
        self._memory_total: dict[str, int] = {}  # guarded by _lock

    def close(self) -> None:
        """Unmap every accounting file kept open."""
        with self._lock:
            self._reader.close()

    def build(self, rates: bool = True, commit: bool = True) -> NodeView:
        """The node now. rates=False: compute_used_ratio 0. commit=False: this view's samples
        do not become the base of later shares until commit(view) (the exporter commits a view
        when a scrape is served, so the share covers the scrape interval)."""
        with self._lock:  # one build at a time: the finder and the reader are not thread-safe
            view = self._build(rates)
        if rates and commit:
            self.commit(view)
        return view

    def commit(self, view: NodeView) -> None:
        self.rates.add(view.samples)

    def _build(self, rates: bool) -> NodeView:
        nv: NvmlReading = self.latest()
        slices = self.finder.find()
        errors: list[str] = [nv.error] if nv.error else []
        troubles: list[tuple[str, str]] = [(e, e) for e in errors]
        gpus: dict[str, GpuReading] = {g.uuid: g for g in nv.gpus}
        by_index = {g.index: g for g in nv.gpus}
        per_gpu: dict[str, list[SliceDeviceView]] = {u: [] for u in gpus}
        all_counters: dict[str, SliceCounters] = {}
        samples: dict[tuple[str, int], tuple[int, int]] = {}
        unreadable: list[UnreadableSlice] = []
        for g in nv.gpus:
            if g.memory_total > 0:
                self._memory_total[g.uuid] = g.memory_total
        now = time.monotonic_ns()
        for s in slices:
            ndev = len(s.gpu_uuids) or max(1, _devices_in_use(s, by_index))
            try:
                c = self._reader.read(s.region_path, ndev, s.region_id)
            except region.RegionError as e:
                errors.append(str(e))
                troubles.append((f"slice {s.key}", str(e)))
                known = tuple(gpus[u] for u in s.gpu_uuids if u in gpus)
                unreadable.append(UnreadableSlice(slice=s, reason=str(e), gpus=known))
                continue
            all_counters[s.key] = c
            for dc in c.devices:
                if not s.gpu_uuids and dc.index > 0 and not _active(dc):
                    continue  # a --region slice shows the devices it used
                if s.gpu_uuids:
                    uuid = s.gpu_uuids[dc.index]
                elif dc.index in by_index:
                    uuid = by_index[dc.index].uuid
                else:
                    uuid = f"device-{dc.index}"
                if uuid not in gpus:
                    gpus[uuid] = _placeholder_gpu(uuid, dc.index if not s.gpu_uuids else -1)
                    per_gpu[uuid] = []
                lim = slice_limits(s, c, dc.index)
                dc, untrusted = _bounded(dc, self._memory_total.get(uuid, 0))
                per_gpu[uuid].append(
                    SliceDeviceView(
                        slice=s,
                        device=dc.index,
                        counters=dc,
                        memory_limit=lim.memory_bytes,
                        compute_limit_ratio=lim.compute_ratio,
                        compute_used_ratio=self.rates.ratio((s.key, dc.index), dc.charged_ns, now)
                        if rates
                        else 0.0,
                        processes=len(c.live_pids),
                        violations=self.violations.slice(s.key, dc.index),
                        without_shim=self.violations.without_shim(s.key, dc.index),
                        untrusted=untrusted,
                        containers=self.containers.get(s.key, dc.index) if self.containers else (),
                        memory_burst_limit=lim.memory_burst_bytes,
                    )
                )
                samples[(s.key, dc.index)] = (now, dc.charged_ns)
        if rates:
            self.rates.forget_except(set(all_counters))
        self._reader.forget_except({s.region_path for s in slices})
        self._lines.report(self, troubles)
        devices = tuple(
            DeviceView(
                gpu=g,
                slices=tuple(per_gpu[u]),
                unattributed_violations=self.violations.unattributed(u),
            )
            for u, g in sorted(gpus.items(), key=lambda kv: (kv[1].index < 0, kv[1].index, kv[0]))
        )
        return NodeView(
            devices=devices,
            errors=tuple(errors),
            counters=all_counters,
            samples=samples,
            unreadable=tuple(unreadable),
        )


def _bounded(dc: DeviceCounters, memory_total: int) -> tuple[DeviceCounters, bool]:
    """The slice's memory figures on a device of `memory_total` bytes (0: not known yet),
    clamped to it, and whether they had to be (the tenant wrote what no slice can hold)."""
    if memory_total <= 0 or (dc.used <= memory_total and dc.peak <= memory_total):
        return dc, False
    return replace(dc, used=min(dc.used, memory_total), peak=min(dc.peak, memory_total)), True


def _devices_in_use(s: Slice, by_index: dict[int, GpuReading]) -> int:
    """A --region slice does not say how many devices it spans: every device NVML reports."""
    return len(by_index)


def _active(dc: DeviceCounters) -> bool:
    return bool(dc.used or dc.peak or dc.denials or dc.launches)

"""The metrics: turns a NodeView, built at scrape time, into Prometheus metric families.

Two renderings of the same tables (_DEVICE, _SLICE, _VIOLATIONS): VgpuCollector, a
prometheus-client custom collector (the reference: register it in any CollectorRegistry), and
render_text(), the exposition the exporter serves, written directly in the text format 0.0.4
with each series' label string built once per scrape. prometheus-client's generic encoder
escapes every label of every sample (about 0.3 s for 512 slices on the 2-core machine);
render_text() does the same in a few milliseconds. tests/sharing/observe/test_metrics_text.py checks that
both give the same samples.

Names, units and labels are documented in docs/metrics.md. Label keys reuse dcgm-exporter's
(`gpu`, `UUID`, `modelName`, `Hostname` and its 2026 spelling `hostname`, `pci_bus_id`; its pod
labels `pod`, `namespace`, `container` and DRA labels `dra_*`) so that dashboards join the two;
every slice series carries the same label set (SLICE_LABELS, "" where unknown) so slice series
join one-to-one. The per-container families (vgpu_container_*, and HAMi's hami_* names with
HAMi's labels, so HAMi's published dashboard renders) come from sharing/observe/containers.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sharing import __version__, region
from sharing.observe.nodeview import (
    ContainerMemory,
    DeviceView,
    NodeView,
    SliceDeviceView,
    UnreadableSlice,
)
from sharing.observe.procinfo import Container
from sharing.observe.slices import Slice, compute_policy

DEVICE_LABELS = ("gpu", "UUID", "modelName", "Hostname", "hostname", "pci_bus_id")
# who the slice is: ours, then dcgm-exporter's pod and DRA labels; last, the compute policy it
# runs under (its limits file's: hard, elastic or off), so an uncapped slice is seen as one
OWNER_LABELS = (
    "claim_uid", "namespace", "claim", "pod", "container",
    "dra_claim_name", "dra_claim_namespace", "dra_driver_name", "dra_pool_name", "dra_device_name",
    "compute_policy",
)  # fmt: skip
SLICE_LABELS = (*DEVICE_LABELS, *OWNER_LABELS)
# HAMi's labels (Project-HAMi/HAMi cmd/vGPUmonitor/metrics.go, cmd/scheduler/metrics.go), plus
# node and claim_uid: a container with two claims on one GPU has a series per claim
HAMI_CONTAINER_LABELS = (
    "namespace", "pod", "container", "vdevice_index", "device_uuid", "node", "claim_uid",
    "container_id",
)  # fmt: skip
# a container's series: the slice's labels with the container's name in `container`, plus its
# runtime ID (two containers of one name, or of no known name, stay apart)
CONTAINER_LABELS = (*SLICE_LABELS, "container_id")
HAMI_DEVICE_LABELS = ("node", "device_uuid", "device_index", "device_type")
HAMI_CORES_TOTAL = "100"  # HAMi counts a GPU's cores in percent

# (name, help, kind, value of a device view)
_DEVICE: tuple[tuple[str, str, str, Callable[[DeviceView], float | None]], ...] = (
    ("vgpu_device_memory_total_bytes", "Device memory NVML reports.", "gauge",
     lambda d: d.gpu.memory_total if d.gpu.healthy else None),
    ("vgpu_device_memory_used_bytes", "Device memory in use, as NVML reports it.", "gauge",
     lambda d: d.gpu.memory_used if d.gpu.healthy else None),
    ("vgpu_device_utilization_ratio", "Fraction of time the device was busy (NVML).", "gauge",
     lambda d: d.gpu.utilization if d.gpu.healthy else None),
    ("vgpu_device_slices", "Slices with a share of this device.", "gauge",
     lambda d: len(d.slices)),
    ("vgpu_device_memory_allocated_bytes", "Sum of the memory quotas of the device's slices.",
     "gauge", lambda d: d.memory_allocated),
    ("vgpu_device_cores_allocated_ratio",
     "Sum of the compute caps of the device's slices (1 = the whole device).", "gauge",
     lambda d: d.cores_allocated_ratio),
    ("vgpu_device_healthy",
     "1 if the last NVML reading of the device succeeded and is fresh, else 0.", "gauge",
     lambda d: 1.0 if d.gpu.healthy else 0.0),
)  # fmt: skip

_SLICE: tuple[tuple[str, str, str, Callable[[SliceDeviceView], float]], ...] = (
    ("vgpu_slice_memory_limit_bytes", "The slice's memory quota on the device (0 = none).",
     "gauge", lambda s: s.memory_limit),
    ("vgpu_slice_memory_used_bytes", "Device memory the slice's live processes hold (shim).",
     "gauge", lambda s: s.counters.used),
    ("vgpu_slice_memory_burst_limit_bytes",
     "The slice's burst limit on the device, above its quota (its request); 0 = it does not burst.",
     "gauge", lambda s: s.memory_burst_limit),
    ("vgpu_slice_memory_borrowed_bytes",
     "Memory the slice uses above its request, borrowed from the device's pool (0 unless it bursts).",
     "gauge", lambda s: s.memory_borrowed),
    ("vgpu_slice_memory_peak_bytes", "Highest memory use of the slice since it was prepared.",
     "gauge", lambda s: s.counters.peak),
    ("vgpu_slice_compute_limit_ratio", "The slice's compute (SM) cap, 0.3 = 30 % (0 = none).",
     "gauge", lambda s: s.compute_limit_ratio),
    ("vgpu_slice_compute_used_ratio",
     "Share of the device's time charged to the slice over the last scrape interval.", "gauge",
     lambda s: s.compute_used_ratio),
    ("vgpu_slice_throttled_seconds", "Time the slice's launches were held back by its cap.",
     "counter", lambda s: s.counters.wait_ns / 1e9),
    ("vgpu_slice_launches", "Kernel launches charged to the slice by the compute gate.",
     "counter", lambda s: s.counters.launches),
    ("vgpu_slice_alloc_denied", "Allocations refused because the slice's quota was reached.",
     "counter", lambda s: s.counters.denials),
    ("vgpu_slice_alloc_denied_bytes", "Bytes asked for by the refused allocations.",
     "counter", lambda s: s.counters.denied_bytes),
    ("vgpu_slice_processes", "Live processes of the slice (those the shim is loaded into).",
     "gauge", lambda s: s.processes),
    ("vgpu_slice_processes_without_shim",
     "GPU processes of the slice on the device that run without the shim (no limit applies to "
     "them), as the watchdog's last pass saw them.", "gauge", lambda s: s.without_shim),
    ("vgpu_slice_untrusted",
     "1 if the slice's accounting file claimed more memory than the device has: its memory "
     "figures are clamped to the device's memory and are not to be believed.", "gauge",
     lambda s: 1.0 if s.untrusted else 0.0),
)  # fmt: skip

VIOLATIONS = "vgpu_slice_quota_violations"  # _total; the watchdog's findings
_VIOLATIONS_HELP = (
    "Watchdog findings: a slice over its quota plus the margin by NVML's count, or (with "
    "empty slice labels) a GPU process of no slice on a shared device."
)
UNREADABLE = "vgpu_slice_unreadable"
_UNREADABLE_HELP = (
    "1 for a slice whose accounting file could not be read as this layout (wrong size, header "
    "or version: truncated or grown by its tenant); one series per GPU of the slice known from "
    "its CDI spec. Its other slice series are absent meanwhile."
)
UNREADABLE_COUNT = "vgpu_slices_unreadable"
_UNREADABLE_COUNT_HELP = "Slices whose accounting file could not be read at this look."
_BUILD_INFO_HELP = "Version of the exporter and the accounting-file layout it reads (always 1)."
_DURATION_HELP = "Time this exporter took to read the node for the exposition served."


def _family(
    name: str, doc: str, kind: str, labels: tuple[str, ...]
) -> CounterMetricFamily | GaugeMetricFamily:
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


def _gpu_labels(index: int, uuid: str, name: str, pci: str, hostname: str) -> list[str]:
    return [str(index) if index >= 0 else "", uuid, name, hostname, hostname, pci]


def device_labels(d: DeviceView, hostname: str) -> list[str]:
    g = d.gpu
    return _gpu_labels(g.index, g.uuid, g.name, g.pci_bus_id, hostname)


# the GPU index in our device names (driver/devicenames.py: gpu-<index>, gpu-<index>-slice-<k>)
_DEVICE_GPU = re.compile(r"gpu-(0|[1-9][0-9]*)(?:-slice-[0-9]+)?")


def _dra_device(sl: Slice, gpu_index: int) -> tuple[str, str]:
    """(pool, device) names of the claim's devices on GPU `gpu_index`, comma-joined when the
    claim has several there (two partitions of one GPU)."""
    pools: list[str] = []
    names: list[str] = []
    for pool, name in sl.dra_devices:
        m = _DEVICE_GPU.fullmatch(name)
        if m is not None and int(m.group(1)) == gpu_index:
            pools += [pool] if pool not in pools else []
            names.append(name)
    return ",".join(pools), ",".join(names)


def owner_labels(
    sl: Slice, gpu_index: int, driver: str, pod: str | None = None, container: str | None = None
) -> list[str]:
    """OWNER_LABELS of a slice on GPU `gpu_index` (-1: unknown). By default `pod` is the
    claim's pod(s) and `container` the names of the containers the kubelet gave it to, each
    comma-joined when several; `compute_policy` is its limits file's ("" when unknown)."""
    claim = bool(sl.claim_uid)
    pool, device = _dra_device(sl, gpu_index) if claim and gpu_index >= 0 else ("", "")
    if container is None:
        container = ",".join(sorted({h.container for h in sl.holders}))
    return [sl.claim_uid, sl.namespace, sl.claim, sl.pod if pod is None else pod, container,
            sl.claim if claim else "", sl.namespace if claim else "", driver if claim else "",
            pool, device, compute_policy(sl)]  # fmt: skip


def slice_labels(d: DeviceView, s: SliceDeviceView, hostname: str, driver: str = "") -> list[str]:
    return [*device_labels(d, hostname), *owner_labels(s.slice, d.gpu.index, driver)]


def unreadable_labels(u: UnreadableSlice, hostname: str, driver: str = "") -> list[list[str]]:
    """One label set per GPU of an unreadable slice (its CDI spec's GPUs NVML knows), or one
    with empty device labels when none is known."""
    sl = u.slice
    out = [
        [*_gpu_labels(g.index, g.uuid, g.name, g.pci_bus_id, hostname),
         *owner_labels(sl, g.index, driver)]
        for g in u.gpus
    ]  # fmt: skip
    return out or [[*_gpu_labels(-1, "", "", "", hostname), *owner_labels(sl, -1, driver)]]


def _one(names: set[str]) -> str:
    return next(iter(names)) if len(names) == 1 else ""


def container_owner(sl: Slice, c: Container) -> tuple[str, str]:
    """(pod, container) names of one container of the slice, "" where they cannot be told.

    The container's name is the kubelet's (its mounts); its pod is the one PodResources lists
    with a container of that name holding the claim. A container of no known name is the
    claim's only holder when the kubelet gave the claim to one container. Without PodResources'
    answer, the pod is the claim's pod when it is reserved for one."""
    hs = sl.holders
    pods = {h.pod for h in hs} if hs else {p for p in sl.pod.split(",") if p}
    if c.name:
        named = {h.pod for h in hs if h.container == c.name}
        return _one(named or pods), c.name
    if len(hs) == 1:
        return hs[0].pod, hs[0].container
    return _one(pods), ""


@dataclass(frozen=True)
class Family:
    """A metric family both renderings write the same way."""

    name: str
    doc: str
    kind: str
    labels: tuple[str, ...]
    rows: list[tuple[list[str], float]]


_CONTAINER_HELP = (
    "Device memory the processes of one container of the slice hold on the GPU, by NVML's count "
    "(with their contexts), as the last NVML pass saw it."
)


def container_families(view: NodeView, hostname: str, driver: str) -> list[Family]:
    """The per-container series (vgpu_container_*; HAMi's hami_vgpu_*/hami_container_*)."""
    ours: dict[tuple[str, ...], float] = {}
    used: dict[tuple[str, ...], float] = {}
    limit: list[tuple[list[str], float]] = []
    util: list[tuple[list[str], float]] = []
    for d in view.devices:
        dl = device_labels(d, hostname)
        for s in d.slices:
            sl = s.slice
            c: ContainerMemory
            for c in s.containers:
                pod, name = container_owner(sl, c.container)
                cid = c.container.short_id
                key = (*dl, *owner_labels(sl, d.gpu.index, driver, pod, name), cid)
                ours[key] = ours.get(key, 0) + c.used_bytes
                hl = (sl.namespace, pod, name, str(s.device), d.gpu.uuid, hostname, sl.claim_uid,
                      cid)  # fmt: skip
                if hl not in used:  # one series per label set: the limit and share are the slice's
                    limit.append((list(hl), s.memory_limit))
                    util.append((list(hl), s.compute_used_ratio * 100))
                used[hl] = used.get(hl, 0) + c.used_bytes
    ours_rows = [(list(k), v) for k, v in ours.items()]
    used_rows = [(list(k), v) for k, v in used.items()]
    return [
        Family("vgpu_container_memory_used_bytes", _CONTAINER_HELP, "gauge", CONTAINER_LABELS,
               ours_rows),
        Family("hami_vgpu_memory_used_bytes",
               "HAMi's name: device memory a container's processes hold (NVML's count).",
               "gauge", HAMI_CONTAINER_LABELS, used_rows),
        Family("hami_container_device_memory_bytes",
               "HAMi's name: device memory a container's processes hold (NVML's count).",
               "gauge", HAMI_CONTAINER_LABELS, used_rows),
        Family("hami_vgpu_memory_limit_bytes",
               "HAMi's name: the memory quota of the container's claim on the device (0 = none).",
               "gauge", HAMI_CONTAINER_LABELS, limit),
        Family("hami_container_device_utilization_ratio",
               "HAMi's name: compute share achieved by the container's claim on the device over "
               "the last scrape interval, 0-100 (HAMi's scale).",
               "gauge", HAMI_CONTAINER_LABELS, util),
    ]  # fmt: skip


def hami_device_families(view: NodeView, hostname: str) -> list[Family]:
    """HAMi's per-device series (its vGPU monitor's and scheduler's names), 0-100 where HAMi's
    are."""
    fams: dict[str, tuple[str, list[tuple[list[str], float]]]] = {
        "hami_host_gpu_memory_used_bytes": ("Device memory in use, as NVML reports it.", []),
        "hami_host_gpu_utilization_ratio": ("Device utilization (NVML), 0-100.", []),
        "hami_gpu_memory_limit_bytes": ("Device memory NVML reports (schedulable memory).", []),
        "hami_gpu_core_limit_ratio": ("The device's cores in percent (always 100).", []),
        "hami_gpu_shared_count": ("Claims (slices) with a share of the device.", []),
        "hami_gpu_core_allocated_ratio": ("Sum of the compute caps of the device's claims, "
                                          "0-100 per device.", []),
        "hami_node_gpu_memory_allocated_ratio": ("Memory quotas allocated / device memory "
                                                 "(0..1, as HAMi computes it).", []),
    }  # fmt: skip
    cores: list[tuple[list[str], float]] = []
    for d in view.devices:
        g = d.gpu
        if g.index < 0:
            continue  # a GPU NVML does not report
        ls = [hostname, g.uuid, str(g.index), f"NVIDIA-{g.name}"]

        def add(name: str, v: float, labels: list[str] = ls) -> None:
            fams[name][1].append((labels, v))

        if g.healthy:
            add("hami_host_gpu_memory_used_bytes", g.memory_used)
            if g.utilization is not None:
                add("hami_host_gpu_utilization_ratio", g.utilization * 100)
        if g.memory_total > 0:
            add("hami_gpu_memory_limit_bytes", g.memory_total)
            add("hami_node_gpu_memory_allocated_ratio", d.memory_allocated / g.memory_total)
        add("hami_gpu_core_limit_ratio", 100)
        add("hami_gpu_shared_count", len(d.slices))
        add("hami_gpu_core_allocated_ratio", d.cores_allocated_ratio * 100)
        cores.append(([*ls, HAMI_CORES_TOTAL], d.memory_allocated))
    out = [Family(n, doc, "gauge", HAMI_DEVICE_LABELS, rows) for n, (doc, rows) in fams.items()]
    out.append(Family("hami_gpu_memory_allocated_bytes",
                      "Sum of the memory quotas of the device's claims.", "gauge",
                      (*HAMI_DEVICE_LABELS, "device_cores"), cores))  # fmt: skip
    return out


class VgpuCollector(Collector):
    """Reads the node at every scrape (build_view), so a scrape always sees the present."""

    def __init__(
        self, build_view: Callable[[], NodeView], hostname: str, driver_name: str = ""
    ) -> None:
        self.build_view = build_view
        self.hostname = hostname
        self.driver_name = driver_name  # the dra_driver_name label of claims' series

    def describe(self) -> list[Metric]:
        return []  # families depend on the node: do not let the registry call collect() early

    def collect(self) -> Iterator[Metric]:
        start = time.perf_counter()
        view = self.build_view()
        yield from self.families(view)
        dur = GaugeMetricFamily("vgpu_exporter_scrape_duration_seconds", _DURATION_HELP)
        dur.add_metric([], time.perf_counter() - start)
        yield dur

    def families(self, view: NodeView) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "vgpu_build_info", _BUILD_INFO_HELP, labels=("version", "region_layout")
        )
        info.add_metric([__version__, str(region.LAYOUT_VERSION)], 1.0)
        yield info
        host, drv = self.hostname, self.driver_name
        for name, doc, kind, dget in _DEVICE:
            fam = _family(name, doc, kind, DEVICE_LABELS)
            for d in view.devices:
                v = dget(d)
                if v is not None:
                    fam.add_metric(device_labels(d, host), float(v))
            yield fam
        for name, doc, kind, sget in _SLICE:
            fam = _family(name, doc, kind, SLICE_LABELS)
            for d in view.devices:
                for s in d.slices:
                    fam.add_metric(slice_labels(d, s, host, drv), float(sget(s)))
            yield fam
        viol = CounterMetricFamily(VIOLATIONS, _VIOLATIONS_HELP, labels=SLICE_LABELS)
        for d in view.devices:
            for s in d.slices:
                viol.add_metric(slice_labels(d, s, host, drv), float(s.violations))
            if d.slices or d.unattributed_violations:
                viol.add_metric([*device_labels(d, host), *[""] * len(OWNER_LABELS)],
                                float(d.unattributed_violations))  # fmt: skip
        yield viol
        bad = GaugeMetricFamily(UNREADABLE, _UNREADABLE_HELP, labels=SLICE_LABELS)
        for u in view.unreadable:
            for labels in unreadable_labels(u, host, drv):
                bad.add_metric(labels, 1.0)
        yield bad
        count = GaugeMetricFamily(UNREADABLE_COUNT, _UNREADABLE_COUNT_HELP)
        count.add_metric([], float(len(view.unreadable)))
        yield count
        for f in (*container_families(view, host, drv), *hami_device_families(view, host)):
            fam = _family(f.name, f.doc, f.kind, f.labels)
            for labels, v in f.rows:
                fam.add_metric(labels, float(v))
            yield fam


# ---- the served exposition ---------------------------------------------------------------------

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(keys: tuple[str, ...], values: list[str]) -> str:
    return ",".join(f'{k}="{_esc(v)}"' for k, v in zip(keys, values, strict=True))


def _num(v: float) -> str:
    if type(v) is int:
        return str(v)
    f = float(v)
    if f.is_integer() and abs(f) < 2**53:
        return str(int(f))
    return repr(f)


def _head(out: list[str], name: str, doc: str, kind: str) -> str:
    sample = f"{name}_total" if kind == "counter" else name
    doc = doc.replace("\\", "\\\\").replace("\n", "\\n")
    out.append(f"# HELP {sample} {doc}\n# TYPE {sample} {kind}\n")
    return sample


def render_text(view: NodeView, hostname: str, started: float, driver_name: str = "") -> bytes:
    """The exposition of `view` (started: time.perf_counter() when the scrape began)."""
    out: list[str] = []
    s = _head(out, "vgpu_build_info", _BUILD_INFO_HELP, "gauge")
    out.append(f'{s}{{version="{_esc(__version__)}",region_layout="{region.LAYOUT_VERSION}"}} 1\n')
    devs = [(d, _labels(DEVICE_LABELS, device_labels(d, hostname))) for d in view.devices]
    slices = [
        (sl, _labels(SLICE_LABELS, slice_labels(d, sl, hostname, driver_name)))
        for d in view.devices
        for sl in d.slices
    ]
    for name, doc, kind, dget in _DEVICE:
        s = _head(out, name, doc, kind)
        for d, ls in devs:
            v = dget(d)
            if v is not None:
                out.append(f"{s}{{{ls}}} {_num(v)}\n")
    for name, doc, kind, sget in _SLICE:
        s = _head(out, name, doc, kind)
        out.extend(f"{s}{{{ls}}} {_num(sget(sl))}\n" for sl, ls in slices)
    s = _head(out, VIOLATIONS, _VIOLATIONS_HELP, "counter")
    out.extend(f"{s}{{{ls}}} {_num(sl.violations)}\n" for sl, ls in slices)
    for d, ls in devs:
        if d.slices or d.unattributed_violations:
            empty = "".join(f',{k}=""' for k in OWNER_LABELS)
            out.append(f"{s}{{{ls}{empty}}} {_num(d.unattributed_violations)}\n")
    s = _head(out, UNREADABLE, _UNREADABLE_HELP, "gauge")
    for u in view.unreadable:
        out.extend(
            f"{s}{{{_labels(SLICE_LABELS, ls)}}} 1\n"
            for ls in unreadable_labels(u, hostname, driver_name)
        )
    s = _head(out, UNREADABLE_COUNT, _UNREADABLE_COUNT_HELP, "gauge")
    out.append(f"{s} {len(view.unreadable)}\n")
    for f in (*container_families(view, hostname, driver_name),
              *hami_device_families(view, hostname)):  # fmt: skip
        s = _head(out, f.name, f.doc, f.kind)
        out.extend(f"{s}{{{_labels(f.labels, ls)}}} {_num(v)}\n" for ls, v in f.rows)
    s = _head(out, "vgpu_exporter_scrape_duration_seconds", _DURATION_HELP, "gauge")
    out.append(f"{s} {time.perf_counter() - started!r}\n")
    return "".join(out).encode()

"""The metrics: turns a NodeView, built at scrape time, into Prometheus metric families.

Two renderings of the same tables (_DEVICE, _SLICE, _VIOLATIONS): VgpuCollector, a
prometheus-client custom collector (the reference: register it in any CollectorRegistry), and
render_text(), the exposition the exporter serves, written directly in the text format 0.0.4
with each series' label string built once per scrape. prometheus-client's generic encoder
escapes every label of every sample (about 0.3 s for 512 slices on the 2-core machine);
render_text() does the same in a few milliseconds. tests/sharing/test_metrics_text.py checks that
both give the same samples.

Names, units and labels are documented in docs/metrics.md. Label keys reuse dcgm-exporter's
(`gpu`, `UUID`, `modelName`, `Hostname`, `pci_bus_id`) so that dashboards join the two; every
slice series carries the same label set (DEVICE_LABELS + SLICE_LABELS, "" where unknown) so
slice series join one-to-one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sharing import __version__, region
from sharing.nodeview import DeviceView, NodeView, SliceDeviceView, UnreadableSlice

DEVICE_LABELS = ("gpu", "UUID", "modelName", "Hostname", "pci_bus_id")
SLICE_LABELS = (*DEVICE_LABELS, "claim_uid", "namespace", "claim", "pod")

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


def device_labels(d: DeviceView, hostname: str) -> list[str]:
    g = d.gpu
    return [str(g.index) if g.index >= 0 else "", g.uuid, g.name, hostname, g.pci_bus_id]


def slice_labels(d: DeviceView, s: SliceDeviceView, hostname: str) -> list[str]:
    sl = s.slice
    return [*device_labels(d, hostname), sl.claim_uid, sl.namespace, sl.claim, sl.pod]


def unreadable_labels(u: UnreadableSlice, hostname: str) -> list[list[str]]:
    """One label set per GPU of an unreadable slice (its CDI spec's GPUs NVML knows), or one
    with empty device labels when none is known."""
    sl = u.slice
    own = [sl.claim_uid, sl.namespace, sl.claim, sl.pod]
    out = [
        [str(g.index) if g.index >= 0 else "", g.uuid, g.name, hostname, g.pci_bus_id, *own]
        for g in u.gpus
    ]
    return out or [["", "", "", hostname, "", *own]]


class VgpuCollector(Collector):
    """Reads the node at every scrape (build_view), so a scrape always sees the present."""

    def __init__(self, build_view: Callable[[], NodeView], hostname: str) -> None:
        self.build_view = build_view
        self.hostname = hostname

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
        host = self.hostname
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
                    fam.add_metric(slice_labels(d, s, host), float(sget(s)))
            yield fam
        viol = CounterMetricFamily(VIOLATIONS, _VIOLATIONS_HELP, labels=SLICE_LABELS)
        for d in view.devices:
            for s in d.slices:
                viol.add_metric(slice_labels(d, s, host), float(s.violations))
            if d.slices or d.unattributed_violations:
                viol.add_metric([*device_labels(d, host), "", "", "", ""],
                                float(d.unattributed_violations))  # fmt: skip
        yield viol
        bad = GaugeMetricFamily(UNREADABLE, _UNREADABLE_HELP, labels=SLICE_LABELS)
        for u in view.unreadable:
            for labels in unreadable_labels(u, host):
                bad.add_metric(labels, 1.0)
        yield bad
        count = GaugeMetricFamily(UNREADABLE_COUNT, _UNREADABLE_COUNT_HELP)
        count.add_metric([], float(len(view.unreadable)))
        yield count


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


def render_text(view: NodeView, hostname: str, started: float) -> bytes:
    """The exposition of `view` (started: time.perf_counter() when the scrape began)."""
    out: list[str] = []
    s = _head(out, "vgpu_build_info", _BUILD_INFO_HELP, "gauge")
    out.append(f'{s}{{version="{_esc(__version__)}",region_layout="{region.LAYOUT_VERSION}"}} 1\n')
    devs = [(d, _labels(DEVICE_LABELS, device_labels(d, hostname))) for d in view.devices]
    slices = [
        (sl, _labels(SLICE_LABELS, slice_labels(d, sl, hostname)))
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
            empty = "".join(f',{k}=""' for k in SLICE_LABELS[len(DEVICE_LABELS) :])
            out.append(f"{s}{{{ls}{empty}}} {_num(d.unattributed_violations)}\n")
    s = _head(out, UNREADABLE, _UNREADABLE_HELP, "gauge")
    for u in view.unreadable:
        out.extend(
            f"{s}{{{_labels(SLICE_LABELS, ls)}}} 1\n" for ls in unreadable_labels(u, hostname)
        )
    s = _head(out, UNREADABLE_COUNT, _UNREADABLE_COUNT_HELP, "gauge")
    out.append(f"{s} {len(view.unreadable)}\n")
    s = _head(out, "vgpu_exporter_scrape_duration_seconds", _DURATION_HELP, "gauge")
    out.append(f"{s} {time.perf_counter() - started!r}\n")
    return "".join(out).encode()

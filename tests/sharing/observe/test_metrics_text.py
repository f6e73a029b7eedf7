"""The served exposition (metrics.render_text, written directly for speed) says exactly what the
prometheus-client collector says: same families, types, samples, labels and values."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sharing.counters import DeviceCounters
from sharing.observe.metrics import VgpuCollector, render_text
from sharing.observe.nodeview import DeviceView, NodeView, SliceDeviceView, UnreadableSlice
from sharing.observe.nvml_reader import GpuReading
from sharing.observe.slices import Slice, region_slice


def _view() -> NodeView:
    g0 = GpuReading(0, "GPU-a", 'Model "quoted" \\ name', "0000:01:00.0", True, 80 << 30, 1 << 30,
                    0.25)  # fmt: skip
    g1 = GpuReading(1, "GPU-b", "", "", False)  # unhealthy: NVML gauges absent
    c = DeviceCounters(0, 5 << 20, 9 << 20, 3, 7 << 20, 12345, 10**9 + 7, 2_500_000)
    s1 = Slice("uid-1", "uid-1", "team\nnewline", "claim-1", "pod-1", "/x", ("GPU-a",), {},
               limits={"VGPU_COMPUTE_POLICY": "off"})  # fmt: skip
    s2 = region_slice(str(Path("/tmp/some.region")))
    sv = [
        SliceDeviceView(s1, 0, c, 1 << 30, 0.3, 0.2875, 2, 1),
        SliceDeviceView(s2, 0, c, 0, 0.0, 0.0, 0, 0, untrusted=True),
    ]
    bad = Slice("uid-2", "uid-2", "team", "claim-2", "", "/y", ("GPU-a", "GPU-x"), {})
    lost = Slice("uid-3", "uid-3", "team", "claim-3", "", "/z", (), {})
    return NodeView(
        devices=(DeviceView(g0, tuple(sv), 2), DeviceView(g1, (), 0)),
        errors=(),
        counters={},
        unreadable=(UnreadableSlice(bad, "/y: size 0", (g0,)), UnreadableSlice(lost, "/z", ())),
    )


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name != "vgpu_exporter_scrape_duration_seconds":
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _types(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_fast_text_equals_the_collector() -> None:
    view = _view()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(VgpuCollector(lambda: view, "node-1"))
    reference = generate_latest(reg).decode()
    fast = render_text(view, "node-1", time.perf_counter()).decode()
    assert _samples(fast) == _samples(reference)
    assert _types(fast) == _types(reference)
    assert len(_samples(fast)) > 20
    assert "vgpu_exporter_scrape_duration_seconds " in fast
    samples = _samples(fast)
    assert samples[("vgpu_slices_unreadable", ())] == 2
    unreadable = {dict(k[1])["claim_uid"]: dict(k[1]) for k in samples
                  if k[0] == "vgpu_slice_unreadable"}  # fmt: skip
    assert unreadable["uid-2"]["UUID"] == "GPU-a" and unreadable["uid-3"]["UUID"] == ""
    untrusted = {dict(k[1])["claim"]: v for k, v in samples.items()
                 if k[0] == "vgpu_slice_untrusted"}  # fmt: skip
    assert untrusted == {"claim-1": 0, "/tmp/some.region": 1}
    # the compute policy of the slice's limits file, "" where its limits are unknown
    policy = {dict(k[1])["claim"]: dict(k[1])["compute_policy"] for k in samples
              if k[0] == "vgpu_slice_memory_limit_bytes"}  # fmt: skip
    assert policy == {"claim-1": "off", "/tmp/some.region": ""}

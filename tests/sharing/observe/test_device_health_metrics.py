"""vgpu_device_healthy follows the plugin's health source (a GPU with a critical XID reads 0
though NVML still reads it), a lost GPU and every GPU while NVML is down keep their series at
0, and vgpu_nvml_up says whether NVML answers. Driven pass by pass (poll_once) so that no test
depends on the poller's timing; render() is exactly what GET /metrics answers."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sharing.observe.exporter import Exporter, ExporterConfig
from sharing.observe.nvml_reader import GPU_LOST, GpuReading, NvmlReading
from tests.support.observers import Sample, only, value

GiB = 1 << 30
UUIDS = ("GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000")


def reading(present: tuple[int, ...] = (0, 1), error: str = "") -> NvmlReading:
    if error:
        return NvmlReading(taken=time.monotonic(), error=error)
    g = tuple(
        GpuReading(i, UUIDS[i], "NVIDIA H100 80GB HBM3", f"00000000:1{i}:00.0", True, 80 * GiB)
        for i in present
    )
    r = NvmlReading(taken=time.monotonic(), gpus=g)
    r.by_uuid.update({x.uuid: x for x in g})
    return r


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.next = reading()
        self.causes: dict[str, str] = {}
        cfg = ExporterConfig(data_dir=tmp_path, hostname="node-a", cache_seconds=0, watchdog=False)
        self.exp = Exporter(cfg, nvml_reader=lambda: self.next, device_health=lambda: self.causes)

    def scrape(self, r: NvmlReading | None = None) -> list[Sample]:
        if r is not None:
            self.next = r
        self.exp.poller.poll_once()
        text = self.exp.render().decode()
        return [
            Sample(s.name, dict(s.labels), s.value)
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        ]


def healthy(s: list[Sample]) -> dict[str, float]:
    return {x.labels["gpu"]: x.value for x in only(s, "vgpu_device_healthy")}


def test_a_gpu_the_health_source_holds_unhealthy_reads_0_until_it_recovers(tmp_path: Path) -> None:
    w = World(tmp_path)
    s = w.scrape()
    assert healthy(s) == {"0": 1, "1": 1}
    w.causes = {UUIDS[1]: "critical XID 79"}
    s = w.scrape()
    assert healthy(s) == {"0": 1, "1": 0}
    assert value(s, "vgpu_nvml_up", Hostname="node-a") == 1  # NVML itself answers
    assert w.exp.health.latest().by_uuid[UUIDS[1]].error == "critical XID 79"
    w.causes = {}
    assert healthy(w.scrape()) == {"0": 1, "1": 1}


def test_nvml_down_keeps_every_known_gpu_at_0_and_says_so(tmp_path: Path) -> None:
    w = World(tmp_path)
    assert healthy(w.scrape()) == {"0": 1, "1": 1}
    s = w.scrape(reading(error="NVML unavailable: Driver Not Loaded"))
    assert healthy(s) == {"0": 0, "1": 0}
    assert value(s, "vgpu_nvml_up", Hostname="node-a") == 0
    assert {x.labels["UUID"] for x in only(s, "vgpu_device_healthy")} == set(UUIDS)
    s = w.scrape(reading())
    assert healthy(s) == {"0": 1, "1": 1}
    assert value(s, "vgpu_nvml_up", Hostname="node-a") == 1


def test_nvml_down_from_the_start_still_says_so(tmp_path: Path) -> None:
    w = World(tmp_path)
    s = w.scrape(reading(error="NVML unavailable: Driver Not Loaded"))
    assert only(s, "vgpu_device_healthy") == []  # no GPU was ever listed
    assert value(s, "vgpu_nvml_up", Hostname="node-a") == 0


def test_a_lost_gpu_keeps_its_series_at_0(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.scrape()
    s = w.scrape(reading(present=(0,)))
    assert healthy(s) == {"0": 1, "1": 0}
    assert w.exp.health.latest().by_uuid[UUIDS[1]].error == GPU_LOST
    assert healthy(w.scrape(reading())) == {"0": 1, "1": 1}


def test_the_registry_serves_vgpu_nvml_up_too(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.scrape(reading(error="NVML unavailable: x"))
    text = generate_latest(w.exp.registry).decode()
    assert 'vgpu_nvml_up{Hostname="node-a"} 0.0' in text
    w.scrape(reading())
    assert 'vgpu_nvml_up{Hostname="node-a"} 1.0' in generate_latest(w.exp.registry).decode()

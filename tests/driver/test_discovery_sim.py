"""Discovery through pynvml over the simulated libnvidia-ml.so.1, in this process."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from driver.discovery import Discovery, Inventory, PynvmlBackend, Rediscovery
from sharing.gpus import use_simulator
from sharing.observe.nvml_reader import GPU_LOST
from sharing.paths import ArtefactMissingError
from tests.support.plugin_e2e import write_config


@pytest.fixture
def sim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    try:
        use_simulator()
    except (ArtefactMissingError, OSError) as e:
        pytest.skip(f"simulated NVML not built: {e}")
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "simgpu.json"
    monkeypatch.setenv("SIMGPU_CONFIG", str(config))
    monkeypatch.setenv("SIMGPU_STATE", str(state))
    return config


def dev(i: int, healthy: bool = True, xid: int = 79) -> dict[str, Any]:
    return {
        "name": "NVIDIA A100-SXM4-40GB",
        "uuid": f"GPU-a100000{i}-0000-0000-0000-000000000000",
        "memory": "40Gi",
        "sm_count": 108,
        "pci_bus_id": f"00000000:{0x40 + i:02X}:00.0",
        "numa_node": 1,
        "compute_capability": "8.0",
        "healthy": healthy,
        "xid": xid,
        "minor": i,
    }


def write(config: Path, devices: list[dict[str, Any]]) -> None:
    write_config(config, devices, driver_version="535.104.05", cuda_version="12.2")


def test_list_and_events_on_the_simulator(sim: Path, tmp_path: Path) -> None:
    write(sim, [dev(0), dev(1, healthy=False, xid=48)])
    backend = PynvmlBackend()
    gpus = backend.list_gpus()
    assert [(g.index, g.uuid, g.memory_total) for g in gpus] == [
        (0, dev(0)["uuid"], 40 * 1024**3),
        (1, dev(1)["uuid"], 40 * 1024**3),
    ]
    inv = Discovery(backend, sysfs_root=tmp_path).inventory(gpus, {})
    assert inv.gpus[1].pcie_root == "pci0000:41"
    assert [g.brand for g in inv.gpus] == ["Nvidia", "Nvidia"]  # an A100's NVML brand
    events = backend.open_events()
    assert events is not None
    try:
        got = events.wait(1.0)
    finally:
        events.close()
    assert [(e.uuid, e.xid) for e in got] == [(dev(1)["uuid"], 48)]


class Recorder:
    def __init__(self) -> None:
        self.seen: list[Inventory] = []
        self.cond = threading.Condition()

    def __call__(self, inv: Inventory) -> None:
        with self.cond:
            self.seen.append(inv)
            self.cond.notify_all()

    def wait_health(self, want: dict[int, bool], timeout: float = 15.0) -> None:
        def ok() -> bool:
            return bool(self.seen) and {g.index: g.healthy for g in self.seen[-1].gpus} == want

        with self.cond:
            assert self.cond.wait_for(ok, timeout), [
                {g.index: g.healthy for g in i.gpus} for i in self.seen
            ]


@pytest.mark.slow
def test_rediscovery_follows_simulated_health(
    sim: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="driver.discovery")
    write(sim, [dev(0), dev(1)])
    rec = Recorder()
    r = Rediscovery(Discovery(PynvmlBackend(), sysfs_root=tmp_path), 0.3, rec)
    t = threading.Thread(target=r.run, daemon=True)
    t.start()
    try:
        rec.wait_health({0: True, 1: True})
        write(sim, [dev(0, healthy=False), dev(1)])  # noticed while the monitor waits
        rec.wait_health({0: False, 1: True})
        assert rec.seen[-1].gpus[0].reason == "critical XID 79"
        write(sim, [dev(0), dev(1)])
        rec.wait_health({0: True, 1: True})
        # An application XID (31, page fault) on an "unhealthy" device does not count.
        n = len(rec.seen)
        write(sim, [dev(0), dev(1, healthy=False, xid=31)])
        deadline = time.monotonic() + 10
        while not any("XID 31 (application error)" in m for m in caplog.messages):
            assert time.monotonic() < deadline, "the simulator's XID 31 never arrived"
            threading.Event().wait(0.05)
        assert len(rec.seen) == n
        write(sim, [dev(0)])  # gpu 1 gone (read at the next nvmlInit): lost
        rec.wait_health({0: True, 1: False})
        assert rec.seen[-1].gpus[1].reason == GPU_LOST
        write(sim, [dev(0), dev(1)])  # back
        rec.wait_health({0: True, 1: True})
    finally:
        r.stop_event.set()
        t.join(10)
    assert not t.is_alive()

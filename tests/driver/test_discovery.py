"""Discovery: versions, PCIe root from sysfs, health from XID events, presence, via an NVML facade."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from driver.discovery import (
    Discovery,
    Inventory,
    Rediscovery,
    XidEvent,
    semver,
    sysfs_bdf,
)
from sharing.observe.nvml_reader import GPU_LOST
from tests.fakes.nvml import FakeEvents, FakeNvml
from tests.support.gpu_records import a100


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("9.0", "9.0.0"),
        ("550.54.15", "550.54.15"),
        ("535.104.05", "535.104.5"),
        ("12", "12.0.0"),
        ("1.2.3.4", "1.2.3+4"),
        ("", None),
        ("r550", None),
        ("9.x", None),
    ],
)
def test_semver(text: str, want: str | None) -> None:
    assert semver(text) == want


def test_sysfs_bdf() -> None:
    assert sysfs_bdf("00000000:3B:00.0") == ("0000:3b:00.0", 0, 0x3B)
    assert sysfs_bdf("0001:af:1f.7") == ("0001:af:1f.7", 1, 0xAF)
    assert sysfs_bdf("3b:00.0") == ("0000:3b:00.0", 0, 0x3B)
    assert sysfs_bdf("nonsense") is None


def make_sysfs(root: Path, bdf: str, chain: list[str]) -> None:
    """A sysfs-like tree: devices/<chain...>/<bdf> and bus/pci/devices/<bdf> -> it."""
    real = root / "devices" / Path(*chain) / bdf
    real.mkdir(parents=True)
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(real, links), links / bdf)


def test_pcie_root_from_sysfs_and_fallback_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_sysfs(tmp_path, "0000:3b:00.0", ["pci0000:3a", "0000:3a:00.0", "0000:3a:02.0"])
    d = Discovery(backend=None, sysfs_root=tmp_path)  # type: ignore[arg-type]
    assert d.pcie_root(a100(0, "00000000:3B:00.0")) == "pci0000:3a"
    caplog.set_level(logging.WARNING)
    assert d.pcie_root(a100(1, "00000000:5E:00.0")) == "pci0000:5e"
    assert d.pcie_root(a100(2, "00000001:86:00.0")) == "pci0001:86"
    fallbacks = [r for r in caplog.records if "no PCI root in sysfs" in r.getMessage()]
    assert len(fallbacks) == 1 and "GPU 1" in fallbacks[0].getMessage()
    assert d.pcie_root(a100(3, "garbage")) is None
    assert any("'garbage' is not domain:bus" in m for m in caplog.messages)


class Recorder:
    def __init__(self) -> None:
        self.seen: list[Inventory] = []
        self.cond = threading.Condition()

    def __call__(self, inv: Inventory) -> None:
        with self.cond:
            self.seen.append(inv)
            self.cond.notify_all()

    def wait_for(self, pred: Callable[[Inventory], bool], timeout: float = 10.0) -> Inventory:
        with self.cond:
            ok = self.cond.wait_for(lambda: self.seen and pred(self.seen[-1]), timeout)
            assert ok, f"timed out; last inventory: {self.seen[-1] if self.seen else None}"
            return self.seen[-1]


def health(inv: Inventory) -> dict[int, bool]:
    return {g.index: g.healthy for g in inv.gpus}


LoopFactory = Callable[..., tuple[Rediscovery, Recorder]]


@pytest.fixture
def loop_factory(tmp_path: Path) -> Iterator[LoopFactory]:
    started: list[tuple[Rediscovery, threading.Thread]] = []

    def make(nvml: FakeNvml, interval: float = 0.3) -> tuple[Rediscovery, Recorder]:
        rec = Recorder()
        r = Rediscovery(Discovery(nvml, sysfs_root=tmp_path), interval, rec)
        t = threading.Thread(target=r.run, daemon=True)
        t.start()
        started.append((r, t))
        return r, rec

    yield make
    for r, t in started:
        r.stop_event.set()
        t.join(5)
        assert not t.is_alive()


def test_critical_xid_marks_unhealthy_at_once_and_recovers(loop_factory: LoopFactory) -> None:
    nvml = FakeNvml([a100(0), a100(1)])
    _, rec = loop_factory(nvml, interval=0.3)
    rec.wait_for(lambda inv: health(inv) == {0: True, 1: True})
    nvml.inject(XidEvent("GPU-1", 79))  # fallen off the bus, while waiting
    inv = rec.wait_for(lambda inv: health(inv) == {0: True, 1: False}, timeout=2)
    assert inv.gpus[1].reason == "critical XID 79"
    # A one-off error recovers after a whole clean round.
    rec.wait_for(lambda inv: health(inv) == {0: True, 1: True}, timeout=5)


def test_persistently_failing_gpu_stays_unhealthy(loop_factory: LoopFactory) -> None:
    nvml = FakeNvml([a100(0), a100(1)])
    nvml.failing["GPU-0"] = 48  # double-bit ECC error, redelivered to every new event set
    _, rec = loop_factory(nvml, interval=0.1)
    rec.wait_for(lambda inv: health(inv) == {0: False, 1: True})
    start = nvml.rounds
    while nvml.rounds < start + 4:
        threading.Event().wait(0.05)
    assert health(rec.seen[-1]) == {0: False, 1: True}
    del nvml.failing["GPU-0"]
    rec.wait_for(lambda inv: health(inv) == {0: True, 1: True})


def test_application_xids_do_not_change_health(loop_factory: LoopFactory) -> None:
    nvml = FakeNvml([a100(0)])
    _, rec = loop_factory(nvml, interval=5)
    rec.wait_for(lambda inv: health(inv) == {0: True})
    nvml.inject(XidEvent("GPU-0", 31))  # page fault of an application
    nvml.inject(XidEvent("GPU-0", 13))
    threading.Event().wait(0.8)
    assert [health(i) for i in rec.seen] == [{0: True}]


def test_presence_change_is_reported(loop_factory: LoopFactory) -> None:
    nvml = FakeNvml([a100(0), a100(1)], events=False)
    _, rec = loop_factory(nvml, interval=0.1)
    rec.wait_for(lambda inv: len(inv.gpus) == 2)
    nvml.gpus = [a100(0)]
    # A GPU NVML stops listing is lost: still there, unhealthy, with the cause.
    inv = rec.wait_for(lambda inv: health(inv) == {0: True, 1: False})
    assert inv.gpus[1].reason == GPU_LOST
    nvml.gpus = [a100(0), a100(1)]  # back: healthy again
    rec.wait_for(lambda inv: health(inv) == {0: True, 1: True})
    nvml.gpus = [a100(0)]
    rec.wait_for(lambda inv: health(inv) == {0: True, 1: False})
    # Another GPU at its index replaces the lost one (device names are by index).
    nvml.gpus = [a100(0), replace(a100(1), uuid="GPU-new")]
    inv = rec.wait_for(lambda inv: health(inv) == {0: True, 1: True})
    assert [g.info.uuid for g in inv.gpus] == [a100(0).uuid, "GPU-new"]
    # Unchanged rounds are not reported.
    n = len(rec.seen)
    threading.Event().wait(0.5)
    assert len(rec.seen) == n


def test_nvml_failure_marks_known_gpus_unhealthy(
    loop_factory: LoopFactory, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml([a100(0)], events=False)
    _, rec = loop_factory(nvml, interval=0.1)
    rec.wait_for(lambda inv: health(inv) == {0: True})
    nvml.broken = RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")
    inv = rec.wait_for(lambda inv: health(inv) == {0: False})
    assert inv.gpus[0].reason == "NVML unreachable: NVML_ERROR_DRIVER_NOT_LOADED"
    nvml.broken = None
    rec.wait_for(lambda inv: health(inv) == {0: True})


def test_events_unavailable_logged_once(
    loop_factory: LoopFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="driver.discovery")
    nvml = FakeNvml([a100(0)], events=False)
    _, rec = loop_factory(nvml, interval=0.05)
    rec.wait_for(lambda inv: True)
    while nvml.rounds < 4:
        threading.Event().wait(0.05)
    msgs = [m for m in caplog.messages if "XID events unavailable" in m]
    assert len(msgs) == 1


def test_a_failing_round_does_not_end_monitoring(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml([a100(0)])
    calls: list[Inventory] = []
    opened: list[FakeEvents] = []
    open_events = nvml.open_events

    def tracking_open() -> FakeEvents | None:
        ev = open_events()
        if ev is not None:
            opened.append(ev)
        return ev

    nvml.open_events = tracking_open  # type: ignore[method-assign]

    def on_change(inv: Inventory) -> None:
        calls.append(inv)
        if len(calls) == 1:
            raise RuntimeError("publisher bug")

    r = Rediscovery(Discovery(nvml, sysfs_root=tmp_path), 0.05, on_change)
    t = threading.Thread(target=r.run, daemon=True)
    t.start()
    try:
        for _ in range(200):
            if len(calls) >= 2:
                break
            threading.Event().wait(0.05)
    finally:
        r.stop_event.set()
        t.join(5)
    assert any("rediscovery round failed" in m for m in caplog.messages)
    # The inventory the failed call did not take is offered again, unchanged.
    assert len(calls) >= 2 and calls[1] == calls[0]
    # The failed round's event set was closed, not leaked (NVML init counts).
    assert opened and all(ev.closed for ev in opened)

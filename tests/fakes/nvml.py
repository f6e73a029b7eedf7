"""A scriptable NVML facade for driver tests (driver.discovery.NvmlBackend)."""

from __future__ import annotations

import threading

from driver.discovery import XidEvent
from sharing.gpus import GpuInfo


class FakeEvents:
    def __init__(self, backend: FakeNvml) -> None:
        self.backend = backend
        self.closed = False
        # Like the simulator: a GPU that is unhealthy now delivers its XID to a new event set.
        self.pending = [XidEvent(u, xid) for u, xid in backend.failing.items()]

    def wait(self, timeout: float) -> list[XidEvent]:
        with self.backend.cond:
            if not self.pending and timeout > 0:
                self.backend.cond.wait(timeout)
            self.pending.extend(self.backend.injected)
            self.backend.injected.clear()
            out, self.pending = self.pending, []
            return out

    def close(self) -> None:
        self.closed = True


class FakeNvml:
    def __init__(self, gpus: list[GpuInfo], events: bool = True) -> None:
        self.gpus = gpus
        self.events = events
        self.failing: dict[str, int] = {}  # uuid -> XID delivered to every new event set
        self.injected: list[XidEvent] = []  # one-off events for the open set
        self.cond = threading.Condition()
        self.broken: Exception | None = None
        self.rounds = 0

    def list_gpus(self) -> list[GpuInfo]:
        self.rounds += 1
        if self.broken:
            raise self.broken
        return list(self.gpus)

    def open_events(self) -> FakeEvents | None:
        return FakeEvents(self) if self.events else None

    def inject(self, ev: XidEvent) -> None:
        with self.cond:
            self.injected.append(ev)
            self.cond.notify_all()

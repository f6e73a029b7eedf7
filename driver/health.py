"""Device health broadcaster: one publisher (discovery), many subscribers (health streams).

`publish({device_name: healthy})` replaces the full list; every subscriber gets the full list,
at subscription and after each change, as the kubelet's NodeWatchResources stream requires.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceHealth:
    device: str
    healthy: bool
    last_updated: int  # Unix seconds of the last change of this device's status


@dataclass(frozen=True)
class HealthSnapshot:
    version: int  # increases on every change
    devices: tuple[DeviceHealth, ...]


class HealthBroadcaster:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._devices: dict[str, DeviceHealth] = {}
        self._version = 0
        self._closed = False

    def publish(self, health: dict[str, bool]) -> bool:
        """Replace the device list; wake subscribers if anything changed. True if it did."""
        now = int(time.time())
        with self._cond:
            new: dict[str, DeviceHealth] = {}
            for name, healthy in sorted(health.items()):
                old = self._devices.get(name)
                if old is not None and old.healthy == healthy:
                    new[name] = old
                else:
                    new[name] = DeviceHealth(name, healthy, now)
            if new == self._devices and self._version > 0:
                return False
            self._devices = new
            self._version += 1
            self._cond.notify_all()
            return True

    def snapshot(self) -> HealthSnapshot:
        with self._cond:
            return HealthSnapshot(self._version, tuple(self._devices.values()))

    def wait_newer(self, version: int, timeout: float) -> HealthSnapshot | None:
        """The snapshot once it is newer than `version`; None on timeout or close."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._version > version, timeout)
            if self._closed or self._version <= version:
                return None
            return HealthSnapshot(self._version, tuple(self._devices.values()))

    def close(self) -> None:
        """End every subscription (at shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

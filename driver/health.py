"""Device health broadcaster: one publisher (discovery), many subscribers (health streams).

`publish({device_name: cause})` replaces the full list (cause "" = healthy, else why the device
is unhealthy: "critical XID 79", "GPU lost", "NVML unreachable: ..."); every subscriber gets the
full list, at subscription, after each change and again every `resend` seconds, as the kubelet's
NodeWatchResources stream requires. The same Inventory feeds the slices' taints
(driver/slicebuild.py) and the exporter's vgpu_device_healthy, so the three never disagree.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

MAX_MESSAGE = 1024  # characters the kubelet keeps of DeviceHealth.message


def message(cause: str) -> str:
    """`cause` as the health stream's message: one line, at most MAX_MESSAGE characters."""
    text = " ".join(cause.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


@dataclass(frozen=True)
class DeviceHealth:
    device: str
    healthy: bool
    message: str = ""  # why it is unhealthy ("" when healthy)


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

    def publish(self, causes: Mapping[str, str]) -> bool:
        """Replace the device list (name -> cause, "" when healthy); wake subscribers if
        anything changed. True if it did."""
        new = {
            name: DeviceHealth(name, not cause, message(cause))
            for name, cause in sorted(causes.items())
        }
        with self._cond:
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

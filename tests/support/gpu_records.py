"""GPU records as NVML describes them, for the driver's tests (an H100 and an A100 with
predictable UUIDs and PCI addresses), and the inventory discovery makes of them."""

from __future__ import annotations

from pathlib import Path

from driver.discovery import Discovery, Inventory
from sharing.gpus import GpuInfo

MiB = 1024**2


def h100(index: int, memory: int = 81559 * MiB, uuid: str | None = None) -> GpuInfo:
    """An H100 80GB whose UUID and PCI address follow its index."""
    return GpuInfo(
        index=index,
        uuid=uuid or f"GPU-{index:08x}-0000-0000-0000-000000000000",
        name="NVIDIA H100 80GB HBM3",
        memory_total=memory,
        memory_used=0,
        pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
        minor=index,
        numa_node=index % 2,
        compute_capability="9.0",
        driver_version="550.54.15",
        cuda_driver_version="12.4",
    )


def a100(index: int, bus: str | None = None) -> GpuInfo:
    """An A100 40GB named GPU-<index>, on `bus` or one that follows its index."""
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA A100-SXM4-40GB",
        memory_total=40 * 1024**3,
        memory_used=0,
        pci_bus_id=bus or f"00000000:{0x10 + index:02X}:00.0",
        minor=index,
        numa_node=None,
        compute_capability="8.0",
        driver_version="535.104.05",
        cuda_driver_version="12.2",
    )


class NoEvents:
    """A discovery source of fixed GPUs and no events."""

    def __init__(self, gpus: list[GpuInfo]) -> None:
        self.gpus = gpus

    def list_gpus(self) -> list[GpuInfo]:
        return list(self.gpus)

    def open_events(self) -> None:
        return None


def inventory(gpus: list[GpuInfo], unhealthy: dict[str, str] | None = None) -> Inventory:
    return Discovery(NoEvents(gpus), sysfs_root=Path("/nonexistent")).inventory(
        gpus, unhealthy or {}
    )

"""The GPUs NVML reports, read through pynvml (the real library, or the simulator's)."""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass
from typing import Any

import pynvml

from sharing.paths import sim_lib_dir


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total: int  # bytes
    memory_used: int  # bytes
    pci_bus_id: str
    minor: int
    numa_node: int | None
    compute_capability: str  # "9.0"
    driver_version: str
    cuda_driver_version: str  # "12.4"
    mig_enabled: bool = False  # MIG mode on: not offered for sharing (docs/operations.md)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def use_simulator() -> None:
    """Make pynvml load the simulated libnvidia-ml.so.1 in this process.

    pynvml dlopens "libnvidia-ml.so.1" by soname; loading ours first by absolute path makes the
    dynamic loader hand back the already-loaded simulator for that soname.
    """
    ctypes.CDLL(str(sim_lib_dir() / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _numa_node(handle: Any) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetNumaNodeId(handle))
    except (pynvml.NVMLError, AttributeError):
        return None


def list_gpus() -> list[GpuInfo]:
    """Every GPU NVML reports. Raises pynvml.NVMLError when NVML cannot be initialised."""
    pynvml.nvmlInit()
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
        cuda_version = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        gpus: list[GpuInfo] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            gpus.append(
                GpuInfo(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    memory_total=int(mem.total),
                    memory_used=int(mem.used),
                    pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                    minor=int(pynvml.nvmlDeviceGetMinorNumber(h)),
                    numa_node=_numa_node(h),
                    compute_capability=f"{major}.{minor}",
                    driver_version=driver,
                    cuda_driver_version=cuda_version,
                    mig_enabled=_mig_enabled(h),
                )
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _mig_enabled(handle: Any) -> bool:
    """MIG mode currently on. GPUs (and drivers, and the simulator) without MIG say so by an
    NVML error: not MIG."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return False
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)

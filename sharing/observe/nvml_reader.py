"""The GPUs as NVML sees them, read by one background thread so that no reader waits on NVML.

A real NVML call can take hundreds of milliseconds (a GPU falling off the bus, a driver busy
with an ECC page retirement). Scrapes and `vgpu top` never call NVML: they take the newest
reading the poller thread made (NvmlPoller.latest()), at most `interval` plus the duration of one
NVML pass old. A pass that has not finished `stale_after` seconds after the previous reading makes
every device read as unhealthy (vgpu_device_healthy 0) and its NVML values absent, so a hung
driver shows as such instead of as frozen numbers. The bound a scrape waits on NVML is therefore
zero: it only copies a reference under a lock held for no more than that copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pynvml

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 1.0  # seconds between NVML passes
DEFAULT_STALE_AFTER = 10.0  # seconds without a finished pass before devices read unhealthy
# Why a GPU NVML once listed is unhealthy: the plugin's health monitor (driver/discovery.py) and
# the exporter's device health say it in the same words.
GPU_LOST = "GPU lost: NVML no longer reports it"


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # in the PID namespace of the reader (the host's, for the plugin's DaemonSet)
    used_bytes: int  # device memory NVML says the process holds (0 if NVML does not know)
    sm_util: int | None = None  # percent of the SMs' time it used over NVML's last sample period


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    healthy: bool  # the last pass read this device without error, and is fresh
    memory_total: int = 0
    memory_used: int = 0
    utilization: float | None = None  # 0..1 over NVML's sample period
    processes: tuple[GpuProcess, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class NvmlReading:
    taken: float  # time.monotonic() of the pass
    gpus: tuple[GpuReading, ...] = ()
    error: str = ""  # NVML itself could not be initialised / listed
    stale: bool = False
    by_uuid: dict[str, GpuReading] = field(default_factory=dict, compare=False)


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _processes(h: Any) -> tuple[GpuProcess, ...]:
    out: dict[int, int] = {}
    for getter in (
        pynvml.nvmlDeviceGetComputeRunningProcesses,
        pynvml.nvmlDeviceGetGraphicsRunningProcesses,
    ):
        try:
            procs = getter(h)
        except pynvml.NVMLError:
            continue
        for p in procs:
            used = p.usedGpuMemory
            # NVML reports "not available" as None (pynvml) or a huge sentinel
            used = int(used) if isinstance(used, int) and used < 1 << 62 else 0
            out[int(p.pid)] = max(out.get(int(p.pid), 0), used)
    util: dict[int, int] = {}
    try:  # the last sample period's (timestamp 0); NOT_FOUND: no process ran a kernel in it
        for s in pynvml.nvmlDeviceGetProcessUtilization(h, 0):
            util[int(s.pid)] = max(util.get(int(s.pid), 0), min(int(s.smUtil), 100))
    except pynvml.NVMLError:
        util = {}
    return tuple(
        GpuProcess(pid, used, util.get(pid, 0) if util else None)
        for pid, used in sorted(out.items())
    )


def read_nvml() -> NvmlReading:
    """One NVML pass over every device (blocking; run it in the poller thread)."""
    now = time.monotonic()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return NvmlReading(taken=now, error=f"NVML unavailable: {e}")
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            gpus.append(_read_gpu(i))
        return _indexed(NvmlReading(taken=time.monotonic(), gpus=tuple(gpus)))
    except pynvml.NVMLError as e:
        return NvmlReading(taken=now, error=f"NVML: cannot list devices: {e}")
    finally:
        pynvml.nvmlShutdown()


def _read_gpu(i: int) -> GpuReading:
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    uuid = _text(pynvml.nvmlDeviceGetUUID(h))
    g = GpuReading(index=i, uuid=uuid, name="", pci_bus_id="", healthy=False)
    try:
        g = replace(
            g,
            name=_text(pynvml.nvmlDeviceGetName(h)),
            pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(h).busId),
        )
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        g = replace(g, memory_total=int(mem.total), memory_used=int(mem.used))
        try:
            util: float | None = int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) / 100.0
        except pynvml.NVMLError_NotSupported:
            util = None
        return replace(g, utilization=util, processes=_processes(h), healthy=True)
    except pynvml.NVMLError as e:
        return replace(g, error=str(e))


def _indexed(r: NvmlReading) -> NvmlReading:
    r.by_uuid.update({g.uuid: g for g in r.gpus})
    return r


class NvmlPoller:
    """Runs `reader` every `interval` seconds in a daemon thread; latest() never blocks on it.

    `on_reading` (the watchdog) runs in the poller thread after each pass.
    """

    def __init__(
        self,
        reader: Callable[[], NvmlReading] = read_nvml,
        interval: float = DEFAULT_INTERVAL,
        stale_after: float = DEFAULT_STALE_AFTER,
        on_reading: Callable[[NvmlReading], None] | None = None,
    ) -> None:
        self.reader = reader
        self.interval = interval
        self.stale_after = stale_after
        self.on_reading = on_reading
        self._lock = threading.Lock()
        self._latest = NvmlReading(taken=time.monotonic(), error="no NVML reading yet")
        self._first = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-poller", daemon=True)

    def start(self, wait_first: float = 5.0) -> None:
        """Start polling; wait up to `wait_first` seconds for the first pass."""
        self._thread.start()
        self._first.wait(wait_first)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval + 5)

    def latest(self) -> NvmlReading:
        with self._lock:
            r = self._latest
        if time.monotonic() - r.taken > self.stale_after and not r.error:
            gpus = tuple(
                replace(g, healthy=False, utilization=None, processes=(), error="stale")
                for g in r.gpus
            )
            return _indexed(NvmlReading(taken=r.taken, gpus=gpus, stale=True))
        return r

    def poll_once(self) -> NvmlReading:
        try:
            r = self.reader()
        except Exception as e:  # a reader bug must not kill the thread
            log.exception("NVML pass failed")
            r = NvmlReading(taken=time.monotonic(), error=f"NVML pass failed: {e}")
        with self._lock:
            self._latest = r
        self._first.set()
        if self.on_reading is not None:
            try:
                self.on_reading(r)
            except Exception:
                log.exception("NVML reading consumer failed")
        return r

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            self.poll_once()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - start)))

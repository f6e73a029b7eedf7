"""The driver's own view of a process, through the node's NVML (pynvml, without the shim): its
device memory and its share of the device's time, found by PID."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pynvml


class UtilizationUnavailable(RuntimeError):
    """This GPU's NVML does not give per-process utilisation. str() is one line."""


class NvmlView:
    """One NVML session on one device (its NVML index)."""

    def __init__(self, index: int) -> None:
        pynvml.nvmlInit()
        self.handle: Any = pynvml.nvmlDeviceGetHandleByIndex(index)

    def close(self) -> None:
        pynvml.nvmlShutdown()

    def used_by(self, pid: int) -> int | None:
        """Device memory NVML charges to `pid`; None when NVML does not list it (a process in
        another PID namespace than this one, on a real driver: NVML names host PIDs)."""
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except pynvml.NVMLError:
            return None
        for p in procs:
            if int(p.pid) == pid:
                return int(p.usedGpuMemory or 0)
        return None

    def share_of(self, pids: list[int], seconds: float) -> dict[int, float | None]:
        """Each process's share of the device (smUtil, percent) over the next `seconds`: the
        median of one sample a second, each covering the time since the previous one (a median:
        one second in which this node's CPUs kept the process from launching says nothing about
        the cap); None for a process NVML never listed."""
        samples: dict[int, list[int]] = {p: [] for p in pids}
        seen: set[int] = set()
        last_us = time.time_ns() // 1000
        deadline = time.monotonic() + seconds
        while time.monotonic() + 1.0 <= deadline + 0.05:
            time.sleep(1.0)
            now_us = time.time_ns() // 1000
            try:
                got = pynvml.nvmlDeviceGetProcessUtilization(self.handle, last_us)
            except pynvml.NVMLError_NotFound:
                got = []  # no process ran a kernel in the period
            except pynvml.NVMLError as e:
                raise UtilizationUnavailable(f"nvmlDeviceGetProcessUtilization: {e}") from e
            by_pid = {int(s.pid): int(s.smUtil) for s in got}
            seen |= by_pid.keys()
            for p in pids:
                samples[p].append(by_pid.get(p, 0))
            last_us = now_us
        return {p: (statistics.median(v) if v and p in seen else None) for p, v in samples.items()}

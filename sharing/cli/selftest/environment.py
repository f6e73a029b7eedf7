"""Environment: the driver and CUDA versions, the GPU (model, SMs, memory, MIG mode), glibc,
whether NVML answers, and whether the shim loads into a driver-API program and into a program on
NVIDIA's CUDA runtime (libcudart)."""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
from pathlib import Path
from typing import Any

import pynvml

from sharing.cli.selftest.probe import ProbeError, Runner
from sharing.cli.selftest.report import FAIL, PASS, SKIP, Check, Report

# The slice the load checks run in: a quota the program must see as its GPU's memory.
LOAD_QUOTA = 1 << 30


def nvml_facts(report: Report, index: int) -> dict[str, Any]:
    """The GPU as NVML reports it; a check saying whether NVML answers."""
    facts: dict[str, Any] = {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        report.add(Check("environment.nvml", FAIL, f"nvmlInit failed: {e}"))
        return facts
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        facts["driver"] = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
        facts["cuda (driver)"] = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        facts["gpu"] = _text(pynvml.nvmlDeviceGetName(h))
        facts["uuid"] = _text(pynvml.nvmlDeviceGetUUID(h))
        facts["memory"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        facts["memory free"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).free)
        facts["mig mode"] = _mig(h)
        report.add(Check("environment.nvml", PASS, f"NVML answers: {facts['gpu']}"))
    except pynvml.NVMLError as e:
        report.add(Check("environment.nvml", FAIL, f"NVML device {index}: {e}"))
    finally:
        pynvml.nvmlShutdown()
    return facts


def _mig(handle: Any) -> str:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return "not supported"
    return "enabled" if current == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled"


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def glibc() -> str:
    return os.confstr("CS_GNU_LIBC_VERSION") or "unknown"


def driver_api_facts(report: Report, runner: Runner, device: int) -> dict[str, str]:
    """The device as the driver API reports it (no shim), then the shim loaded into the same
    driver-API program: it must see its slice's quota as the GPU's memory."""
    try:
        kv = runner.run(runner.base_env(), "env", str(device))
    except ProbeError as e:
        report.add(Check("environment.driver_api", FAIL, f"the driver API does not answer: {e}"))
        return {}
    env = runner.slice_env("load", memory=LOAD_QUOTA)
    try:
        seen = runner.run(env, "env", str(device))
    except ProbeError as e:
        report.add(Check("environment.shim_driver_api", FAIL, f"with the shim: {e}"))
        return kv
    total = int(seen.get("total", "0"))
    ok = total == LOAD_QUOTA
    report.add(
        Check(
            "environment.shim_driver_api",
            PASS if ok else FAIL,
            f"a driver-API program under the shim sees {total} bytes of GPU memory",
            threshold=f"its slice's quota, {LOAD_QUOTA} bytes",
            numbers={"seen_total": total, "quota": LOAD_QUOTA},
        )
    )
    return kv


def find_cudart(cuda_driver: int) -> list[Path]:
    """NVIDIA's CUDA runtimes this Python can find (the nvidia-cuda-runtime wheels, then the
    system's), newest first, those the driver supports (a runtime needs a driver at least as new
    as its major version)."""
    found: list[tuple[int, Path]] = []
    spec = importlib.util.find_spec("nvidia")  # the wheels' namespace package, if any
    for base in (spec.submodule_search_locations or []) if spec else []:
        for rel, major in (("cu13/lib/libcudart.so.13", 13), ("cuda_runtime/lib/libcudart.so.12", 12)):  # fmt: skip
            p = Path(base) / rel
            if p.is_file():
                found.append((major, p))
    sys_lib = ctypes.util.find_library("cudart")
    if sys_lib:
        found.append((0, Path(sys_lib)))
    return [p for major, p in found if major * 1000 <= cuda_driver]


def cudart_check(report: Report, runner: Runner, device: int, cuda_driver: int) -> None:
    libs = find_cudart(cuda_driver)
    if not libs:
        report.add(Check("environment.shim_cudart", SKIP, "skipped: no libcudart (install the "
                         "nvidia-cuda-runtime-cu12 wheel to run this check)"))  # fmt: skip
        return
    lib = libs[0]
    env = runner.slice_env("load", memory=LOAD_QUOTA)
    try:
        kv = runner.run(env, "cudart", str(lib), str(device))
    except ProbeError as e:
        report.add(Check("environment.shim_cudart", FAIL, f"{lib.name} under the shim: {e}"))
        return
    total = int(kv.get("total", "0"))
    report.add(
        Check(
            "environment.shim_cudart",
            PASS if total == LOAD_QUOTA else FAIL,
            f"a CUDA-runtime program ({lib.name}) under the shim sees {total} bytes (cudaMemGetInfo)",
            threshold=f"its slice's quota, {LOAD_QUOTA} bytes",
            numbers={"runtime": str(lib), "seen_total": total, "quota": LOAD_QUOTA},
        )
    )

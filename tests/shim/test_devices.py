"""Quotas per device, indexed as the application sees devices (CUDA_VISIBLE_DEVICES need not
start at 0), and the slice's view through NVML."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sharing import region
from sharing.paths import sim_lib_dir
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.shim_ops import Held, device_used, run_ops

MiB = 1 << 20
GiB = 1 << 30


def two_devices(tmp_path: Path) -> str:
    cfg = tmp_path / "sim2.json"
    cfg.write_text(json.dumps({"devices": [{"memory": GiB}, {"memory": 2 * GiB}]}))
    return str(cfg)


def test_per_device_limits(shim_ops: Path, shim_env: dict[str, str], tmp_path: Path) -> None:
    reg = tmp_path / "slice.region"
    env = dict(
        shim_env,
        SIMGPU_CONFIG=two_devices(tmp_path),
        CUDA_DEVICE_MEMORY_LIMIT_0="64Mi",
        CUDA_DEVICE_MEMORY_LIMIT_1="128Mi",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg),
        SIMGPU_CONTEXT_MEMORY="0",  # exact allocation bytes in quotas smaller than a context
    )
    res = run_ops(
        shim_ops, env, "init", "ctx:0", f"alloc:{48 * MiB}", f"alloc:{48 * MiB}", "info", "total:0",
        "ctx:1", f"alloc:{96 * MiB}", f"alloc:{48 * MiB}", "info", "total:1",
    )  # fmt: skip
    assert [r["rc"] for r in res] == ["0", "0", "0", "2", "0", "0", "0", "0", "2", "0", "0"]
    assert res[4]["total"] == str(64 * MiB) and res[4]["free"] == str(16 * MiB)
    assert res[5]["total"] == str(64 * MiB)
    assert res[9]["total"] == str(128 * MiB) and res[9]["free"] == str(32 * MiB)
    assert res[10]["total"] == str(128 * MiB)


def test_visible_devices_not_starting_at_zero(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """CUDA_VISIBLE_DEVICES=1: the application's device 0 is physical device 1, and quota 0 is its."""
    reg = tmp_path / "slice.region"
    cfg = two_devices(tmp_path)
    plain = {k: v for k, v in shim_env.items() if k != "LD_PRELOAD"}
    seen = run_ops(
        shim_ops, dict(plain, SIMGPU_CONFIG=cfg, CUDA_VISIBLE_DEVICES="1"), "init", "total:0"
    )
    if seen[1]["total"] != str(2 * GiB):
        pytest.skip("the simulator does not implement CUDA_VISIBLE_DEVICES yet")
    env = dict(
        shim_env,
        SIMGPU_CONTEXT_MEMORY="0",  # exact allocation bytes in a quota smaller than a context
        SIMGPU_CONFIG=cfg,
        CUDA_VISIBLE_DEVICES="1",
        CUDA_DEVICE_MEMORY_LIMIT_0="64Mi",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg),
    )
    held = Held(shim_ops, env, "init", "ctx:0", "total:0", f"alloc:{48 * MiB}", f"alloc:{48 * MiB}")
    try:
        assert [r["rc"] for r in held.results] == ["0", "0", "0", "0", "2"]
        assert held.results[2]["total"] == str(64 * MiB)
        all_devices = dict(shim_env, SIMGPU_CONFIG=cfg, SIMGPU_CONTEXT_MEMORY="0")
        assert device_used(shim_ops, all_devices, 1) == 48 * MiB  # physical device 1 was charged
        assert device_used(shim_ops, all_devices, 0) == 0
        assert region.read(reg).devices[0].used == 48 * MiB  # under the app's index 0
        # NVML (which ignores CUDA_VISIBLE_DEVICES) shows the slice on physical device 1 only.
        # This NVML-only process knows which device "1" is only if CUDA's order is NVML's (PCI
        # bus order); fastest-first (the default) it cannot tell, and shows the driver's numbers.
        nvml = nvml_memory(dict(env, CUDA_DEVICE_ORDER="PCI_BUS_ID"), [0, 1])
        assert nvml[1] == {"total": 64 * MiB, "used": 48 * MiB, "free": 16 * MiB}
        assert nvml[0]["total"] == GiB
        nvml = nvml_memory(dict(env), [0, 1])
        assert (nvml[0]["total"], nvml[1]["total"]) == (GiB, 2 * GiB)
    finally:
        held.release()


NVML_SCRIPT = """
import ctypes, json, sys
ctypes.CDLL(sys.argv[1] + "/libnvidia-ml.so.1", mode=ctypes.RTLD_GLOBAL)
import pynvml
pynvml.nvmlInit()
out = {}
for i in json.loads(sys.argv[2]):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    out[i] = {"total": m.total, "used": m.used, "free": m.free, "v2_total": m2.total, "v2_free": m2.free}
print(json.dumps(out))
"""


def nvml_memory(env: dict[str, str], indices: list[int]) -> dict[int, dict[str, int]]:
    r = subprocess.run(
        [sys.executable, "-c", NVML_SCRIPT, str(sim_lib_dir()), json.dumps(indices)],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    raw = json.loads(r.stdout)
    out: dict[int, dict[str, int]] = {}
    for k, v in raw.items():
        assert v["v2_total"] == v["total"] and v["v2_free"] == v["free"], v
        out[int(k)] = {"total": v["total"], "used": v["used"], "free": v["free"]}
    return out


def test_nvml_shows_the_slice(shim_ops: Path, shim_env: dict[str, str], tmp_path: Path) -> None:
    reg = tmp_path / "slice.region"
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="1Gi", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg))
    held = Held(shim_ops, env, "init", "ctx", f"alloc:{100 * MiB}")
    try:
        used = 100 * MiB + CONTEXT_MEMORY  # its allocation and its context
        assert nvml_memory(env, [0])[0] == {"total": GiB, "used": used, "free": GiB - used}
    finally:
        held.release()


BRAND_SCRIPT = """
import ctypes, sys
ctypes.CDLL(sys.argv[1] + "/libnvidia-ml.so.1", mode=ctypes.RTLD_GLOBAL)
import pynvml
pynvml.nvmlInit()
print(pynvml.nvmlDeviceGetBrand(pynvml.nvmlDeviceGetHandleByIndex(0)))
"""


def test_nvml_calls_the_shim_does_not_hook_reach_the_driver(
    shim_env: dict[str, str], tmp_path: Path
) -> None:
    """nvmlDeviceGetBrand is not in hooks.def: under the shim, with a slice, it answers what the
    driver answers without the shim (NVML_BRAND_NVIDIA for the simulated H100)."""
    env = dict(
        shim_env,
        CUDA_DEVICE_MEMORY_LIMIT="1Gi",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "slice.region"),
    )
    bare = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    got = [
        subprocess.run(
            [sys.executable, "-c", BRAND_SCRIPT, str(sim_lib_dir())],
            env=e,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
        for e in (env, bare)
    ]
    assert got == ["14", "14"]

"""NVML's view of a slice when CUDA's device order is not NVML's.

NVML enumerates in PCI bus order and ignores CUDA_VISIBLE_DEVICES; CUDA enumerates fastest
first by default (CUDA_DEVICE_ORDER), and numeric CUDA_VISIBLE_DEVICES entries index that order.
Here device A (PCI 01, 40 SMs) is NVML index 0 but the slower one, so the application's
device 0 is B (PCI 02, 132 SMs): quota 0 must show on B's NVML handle, never on A's. When the
shim cannot know which device an NVML handle is to the application (NVML only, numeric or no
CUDA_VISIBLE_DEVICES, fastest-first order) it shows the driver's numbers, not a wrong slice.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sharing.paths import sim_lib_dir

GiB = 1 << 30
UUID_A = "GPU-aaaaaaaa-0000-4e00-8000-00000000000a"
UUID_B = "GPU-bbbbbbbb-0000-4e00-8000-00000000000b"
BUS_A = "00000000:01:00.0"
BUS_B = "00000000:02:00.0"
TOTAL_A = 16 * GiB
TOTAL_B = 80 * GiB

PROBE = """
import ctypes, json, sys
ctypes.CDLL(sys.argv[1] + "/libnvidia-ml.so.1", mode=ctypes.RTLD_GLOBAL)
import pynvml as nv
out = {}
if sys.argv[2] == "cuda":
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    d, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert cu.cuDeviceGet(ctypes.byref(d), 0) == 0
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    out["cuda0"] = total.value
nv.nvmlInit()
for i in range(nv.nvmlDeviceGetCount()):
    h = nv.nvmlDeviceGetHandleByIndex(i)
    bus = nv.nvmlDeviceGetPciInfo(h).busId
    bus = bus.decode() if isinstance(bus, bytes) else bus
    m1 = nv.nvmlDeviceGetMemoryInfo(h).total
    m2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2).total
    assert m1 == m2, (m1, m2)
    out[bus] = m1
print(json.dumps(out))
"""


@pytest.fixture
def order_env(shim_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    cfg = tmp_path / "two.json"
    devices = [
        {"name": "A", "uuid": UUID_A, "pci_bus_id": BUS_A, "sm_count": 40, "memory": TOTAL_A},
        {"name": "B", "uuid": UUID_B, "pci_bus_id": BUS_B, "sm_count": 132, "memory": TOTAL_B},
    ]
    cfg.write_text(json.dumps({"devices": devices}))
    env = dict(shim_env, SIMGPU_CONFIG=str(cfg))
    env["CUDA_DEVICE_MEMORY_LIMIT_0"] = "4Gi"
    env["CUDA_DEVICE_MEMORY_LIMIT_1"] = "0"  # no quota on the application's device 1
    env.pop("CUDA_DEVICE_ORDER", None)
    return env


def probe(env: dict[str, str], mode: str) -> dict[str, int]:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(sim_lib_dir()), mode],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got: dict[str, int] = json.loads(r.stdout)
    return got


# (mode, CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES, NVML total of A, of B; app device 0)
CASES = [
    # CUDA initialised in the process: the shim matches NVML handles by CUDA's own UUIDs
    ("cuda", None, None, TOTAL_A, 4 * GiB, "B"),
    ("cuda", "FASTEST_FIRST", "0", TOTAL_A, 4 * GiB, "B"),
    ("cuda", None, "1", 4 * GiB, TOTAL_B, "A"),
    ("cuda", None, UUID_B, TOTAL_A, 4 * GiB, "B"),
    ("cuda", None, f"{UUID_A},{UUID_B}", 4 * GiB, TOTAL_B, "A"),
    ("cuda", "PCI_BUS_ID", None, 4 * GiB, TOTAL_B, "A"),
    ("cuda", "PCI_BUS_ID", "1", TOTAL_A, 4 * GiB, "B"),
    # NVML only: UUID entries name the device ...
    ("nvml", None, UUID_B, TOTAL_A, 4 * GiB, None),
    ("nvml", None, f"{UUID_A},{UUID_B}", 4 * GiB, TOTAL_B, None),
    ("nvml", None, "GPU-bbbb", TOTAL_A, 4 * GiB, None),  # a unique UUID prefix
    ("nvml", None, "GPU-bbbb,GPU-", TOTAL_A, 4 * GiB, None),
    ("nvml", None, "GPU-,GPU-bbbb", TOTAL_A, TOTAL_B, None),  # ambiguous: the list ends there
    # ... numeric entries (or none) only in PCI order, which is NVML's ...
    ("nvml", "PCI_BUS_ID", None, 4 * GiB, TOTAL_B, None),
    ("nvml", "PCI_BUS_ID", "1", TOTAL_A, 4 * GiB, None),
    ("nvml", "PCI_BUS_ID", "1,0", TOTAL_A, 4 * GiB, None),
    # ... otherwise the application's device is unknown: the driver's numbers, not a guess
    ("nvml", None, None, TOTAL_A, TOTAL_B, None),
    ("nvml", None, "0", TOTAL_A, TOTAL_B, None),
    ("nvml", "FASTEST_FIRST", "1", TOTAL_A, TOTAL_B, None),
]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "order", "visible", "nvml_a", "nvml_b", "app0"), CASES)
def test_nvml_slice_is_on_the_applications_device(
    order_env: dict[str, str],
    mode: str,
    order: str | None,
    visible: str | None,
    nvml_a: int,
    nvml_b: int,
    app0: str | None,
) -> None:
    env = dict(order_env)
    if order is not None:
        env["CUDA_DEVICE_ORDER"] = order
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    got = probe(env, mode)
    assert got[BUS_A] == nvml_a and got[BUS_B] == nvml_b, got
    if app0 is not None:
        assert got["cuda0"] == 4 * GiB  # cuMemGetInfo of ordinal 0: its quota, whichever device


def test_sim_cuda_order_without_the_shim(order_env: dict[str, str]) -> None:
    """The premise: without the shim, CUDA's device 0 is B (fastest first), NVML's index 0 is A."""
    env = {k: v for k, v in order_env.items() if k != "LD_PRELOAD"}
    got = probe(env, "cuda")
    assert got == {"cuda0": TOTAL_B, BUS_A: TOTAL_A, BUS_B: TOTAL_B}
    got = probe(dict(env, CUDA_DEVICE_ORDER="PCI_BUS_ID"), "cuda")
    assert got["cuda0"] == TOTAL_A

"""CUDA's device order (CUDA_DEVICE_ORDER, and CUDA_VISIBLE_DEVICES indices into it) against
NVML's, which is always PCI bus order, as with NVIDIA's driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sim.simhelp import run_python, write_config

pytestmark = pytest.mark.slow

# Listed out of PCI order on purpose. Speeds (SMs x compute capability): 40*80, 132*90, 132*90,
# 108*80. FASTEST_FIRST: the two 132-SM devices (ties in PCI order), then 108, then 40.
DEVICES = [
    {"name": "D", "pci_bus_id": "0000:04:00.0", "sm_count": 108, "compute_capability": "8.0"},
    {"name": "A", "pci_bus_id": "0000:01:00.0", "sm_count": 40, "compute_capability": "8.0"},
    {"name": "C", "pci_bus_id": "0000:03:00.0", "sm_count": 132, "compute_capability": "9.0"},
    {"name": "B", "pci_bus_id": "0000:02:00.0", "sm_count": 132, "compute_capability": "9.0"},
]

PROBE = """
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
nv.nvmlInit()
nvml = [text(nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i))) for i in range(nv.nvmlDeviceGetCount())]
cuda = []
if cu.cuInit(0) == 0:
    n = ctypes.c_int()
    assert cu.cuDeviceGetCount(ctypes.byref(n)) == 0
    for i in range(n.value):
        d = ctypes.c_int()
        assert cu.cuDeviceGet(ctypes.byref(d), i) == 0
        name = ctypes.create_string_buffer(96)
        assert cu.cuDeviceGetName(name, 96, d) == 0
        cuda.append(name.value.decode())
print(json.dumps({"nvml": nvml, "cuda": cuda}))
"""


@pytest.mark.parametrize(
    ("order", "visible", "cuda"),
    [
        (None, None, ["B", "C", "D", "A"]),
        ("FASTEST_FIRST", None, ["B", "C", "D", "A"]),
        ("bogus", None, ["B", "C", "D", "A"]),  # unknown values are ignored, as by the real driver
        ("PCI_BUS_ID", None, ["A", "B", "C", "D"]),
        (None, "3,0", ["A", "B"]),  # indices into the CUDA order
        ("PCI_BUS_ID", "3,0", ["D", "A"]),
        (None, "GPU-5a1d0c0e-1001", ["A"]),  # UUIDs name a device whatever the order
    ],
)
def test_cuda_order_follows_cuda_device_order_nvml_stays_pci(
    sim_env: dict[str, str], tmp_path: Path, order: str | None, visible: str | None, cuda: list[str]
) -> None:
    env = {**sim_env, "SIMGPU_CONFIG": str(write_config(tmp_path, {"devices": DEVICES}))}
    env.pop("CUDA_DEVICE_ORDER", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if order is not None:
        env["CUDA_DEVICE_ORDER"] = order
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    got = run_python(env, PROBE)
    assert got == {"nvml": ["A", "B", "C", "D"], "cuda": cuda}

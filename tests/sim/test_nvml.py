"""pynvml, unmodified, reads every field the simulator provides; XID events of unhealthy devices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sim.simhelp import CONTEXT_MEMORY, Client, run_python, write_config

# The byte counts of these tests are exact for a driver taking 512 B granules (the page model of
# the default, 2 MiB pages, is tested in test_pages.py).
pytestmark = pytest.mark.simgpu(SIMGPU_ALLOC_GRANULARITY="512")


GB = 10**9

EVERYTHING = """
nv.nvmlInit()
out = {
    "driver": text(nv.nvmlSystemGetDriverVersion()),
    "cuda": nv.nvmlSystemGetCudaDriverVersion(),
    "cuda_v2": nv.nvmlSystemGetCudaDriverVersion_v2(),
    "nvml_version": text(nv.nvmlSystemGetNVMLVersion()),
    "count": nv.nvmlDeviceGetCount(),
}
h = nv.nvmlDeviceGetHandleByIndex(0)
uuid = text(nv.nvmlDeviceGetUUID(h))
pci = nv.nvmlDeviceGetPciInfo(h)
m1 = nv.nvmlDeviceGetMemoryInfo(h)
m2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
u = nv.nvmlDeviceGetUtilizationRates(h)
procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
procs_v2 = nv.nvmlDeviceGetComputeRunningProcesses_v2(h)
samples = nv.nvmlDeviceGetProcessUtilization(h, 0)
out.update({
    "name": text(nv.nvmlDeviceGetName(h)), "uuid": uuid, "index": nv.nvmlDeviceGetIndex(h),
    "by_uuid_same": nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(uuid)) == 0,
    "by_pci_same": nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByPciBusId(pci.busId)) == 0,
    "bus_id": text(pci.busId), "bus_id_legacy": text(pci.busIdLegacy), "domain": pci.domain, "bus": pci.bus,
    "device": pci.device, "pci_device_id": pci.pciDeviceId,
    "minor": nv.nvmlDeviceGetMinorNumber(h), "numa": nv.nvmlDeviceGetNumaNodeId(h),
    "cc": list(nv.nvmlDeviceGetCudaComputeCapability(h)), "brand": nv.nvmlDeviceGetBrand(h),
    "mem_v1": [m1.total, m1.used, m1.free], "mem_v2": [m2.total, m2.reserved, m2.used, m2.free],
    "util": [u.gpu, u.memory],
    "procs": [[p.pid, p.usedGpuMemory] for p in procs],
    "procs_v2": [[p.pid, p.usedGpuMemory] for p in procs_v2],
    "samples": [[s.pid, s.smUtil, s.timeStamp > 0] for s in samples],
    "events": nv.nvmlDeviceGetSupportedEventTypes(h),
})
try:
    nv.nvmlDeviceGetHandleByIndex(5)
    out["bad_index"] = "no error"
except nv.NVMLError as e:
    out["bad_index"] = str(e)
try:
    nv.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    out["bad_uuid"] = "no error"
except nv.NVMLError as e:
    out["bad_uuid"] = str(e)
nv.nvmlShutdown()
try:
    nv.nvmlDeviceGetCount()
    out["after_shutdown"] = "no error"
except nv.NVMLError as e:
    out["after_shutdown"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_pynvml_reads_every_field(sim_tool: Path, sim_env: dict[str, str]) -> None:
    load = Client(sim_tool, sim_env, "load", "1000", "10", "10", "4")
    holder = Client(sim_tool, sim_env, "hold", str(3 * GB))
    try:
        got = run_python(sim_env, "time.sleep(1.2)\n" + EVERYTHING)
    finally:
        holder.finish()
        load.finish(timeout=60)
    assert got["driver"] == "580.95.05" and got["cuda"] == 13000 and got["cuda_v2"] == 13000
    assert got["nvml_version"] == "13.580.95.05"
    assert got["count"] == 1 and got["index"] == 0
    assert got["name"] == "NVIDIA H100 80GB HBM3"
    assert got["uuid"].startswith("GPU-") and len(got["uuid"]) == 40
    assert got["by_uuid_same"] and got["by_pci_same"]
    assert got["bus_id"] == "00000000:18:00.0" and got["bus_id_legacy"] == "0000:18:00.0"
    assert (got["domain"], got["bus"], got["device"]) == (0, 0x18, 0)
    assert got["pci_device_id"] == 0x233010DE
    assert got["minor"] == 0 and got["numa"] == 0 and got["cc"] == [9, 0]
    assert got["brand"] == 14  # NVML_BRAND_NVIDIA, as an H100 reports it
    total = 80 << 30
    used = 3 * GB + 2 * CONTEXT_MEMORY  # the holder's allocation, both processes' contexts
    assert got["mem_v1"] == [total, used, total - used]
    assert got["mem_v2"] == [total, 0, used, total - used]
    assert got["util"][0] >= 97 and got["util"][1] == 0
    expect = [[holder.pid, 3 * GB + CONTEXT_MEMORY], [load.pid, CONTEXT_MEMORY]]
    assert sorted(got["procs"]) == sorted(expect)
    assert sorted(got["procs_v2"]) == sorted(got["procs"])
    samples = {pid: (sm, ts) for pid, sm, ts in got["samples"]}
    assert samples[load.pid][0] >= 95 and samples[load.pid][1]
    assert samples[holder.pid][0] == 0
    assert got["events"] & 0x8  # XID critical errors
    assert got["bad_index"] == "Invalid Argument" and got["bad_uuid"] == "Not Found"
    assert got["after_shutdown"] == "Uninitialized"


@pytest.mark.slow
def test_sharing_info_lists_the_simulated_gpu(sim_env: dict[str, str]) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "sharing.cli", "info", "--sim"],
        env=sim_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "NVIDIA H100 80GB HBM3" in r.stdout and "81920 MiB" in r.stdout


# Product names and the brand current drivers report for them (nvidia-smi's "Product Brand").
BRANDS = {
    "NVIDIA H100 80GB HBM3": 14, "NVIDIA A100-SXM4-40GB": 14, "NVIDIA L4": 14, "Tesla T4": 14,
    "NVIDIA GeForce RTX 4090": 5, "NVIDIA RTX A6000": 13, "NVIDIA TITAN RTX": 6, "Quadro P4000": 1,
}  # fmt: skip


def test_brand_of_each_simulated_product(sim_env: dict[str, str], tmp_path: Path) -> None:
    names = list(BRANDS)
    config = {"devices": [{"name": n} for n in names]}
    env = {**sim_env, "SIMGPU_CONFIG": str(write_config(tmp_path, config))}
    got = run_python(
        env,
        """
nv.nvmlInit()
out = {}
for i in range(nv.nvmlDeviceGetCount()):
    h = nv.nvmlDeviceGetHandleByIndex(i)
    out[text(nv.nvmlDeviceGetName(h))] = nv.nvmlDeviceGetBrand(h)
print(json.dumps(out))
""",
    )
    assert got == BRANDS


XID_CONFIG = {
    "devices": [
        {"uuid": "GPU-11111111-1111-4111-8111-111111111111"},
        {"uuid": "GPU-22222222-2222-4222-8222-222222222222", "healthy": False, "xid": 48},
        {"uuid": "GPU-33333333-3333-4333-8333-333333333333", "healthy": False},
    ]
}

WAIT_EVENTS = """
nv.nvmlInit()
def register(indices):
    s = nv.nvmlEventSetCreate()
    for i in indices:
        nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(i), nv.nvmlEventTypeXidCriticalError, s)
    return s
def drain(s, timeout_ms=300):
    got = []
    while True:
        try:
            d = nv.nvmlEventSetWait_v2(s, timeout_ms)
        except nv.NVMLError_Timeout:
            return got
        got.append([nv.nvmlDeviceGetIndex(d.device), d.eventType, d.eventData])
first = register([0, 1, 2])
healthy_only = register([0])
out = {"first": drain(first), "healthy_only": drain(healthy_only), "again": drain(first)}
late = register([1])  # registered after the device became unhealthy: still told
out["late"] = drain(late)
for s in (first, healthy_only, late):
    nv.nvmlEventSetFree(s)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_xid_events_of_unhealthy_devices(sim_env: dict[str, str], tmp_path: Path) -> None:
    env = {**sim_env, "SIMGPU_CONFIG": str(write_config(tmp_path, XID_CONFIG))}
    got = run_python(env, WAIT_EVENTS)
    xid = 0x8
    assert sorted(got["first"]) == [[1, xid, 48], [2, xid, 79]]
    assert got["healthy_only"] == []
    assert got["again"] == []  # once per set while the device stays unhealthy
    assert got["late"] == [[1, xid, 48]]


def test_health_flip_is_seen_by_a_waiting_monitor(sim_env: dict[str, str], tmp_path: Path) -> None:
    path = write_config(tmp_path, {"devices": [{}]})
    env = {**sim_env, "SIMGPU_CONFIG": str(path)}
    broken = json.dumps({"devices": [{"healthy": False, "xid": 94}]})
    got = run_python(
        env,
        f"""
import pathlib, threading
nv.nvmlInit()
s = nv.nvmlEventSetCreate()
nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlEventTypeXidCriticalError, s)
threading.Timer(0.5, lambda: pathlib.Path({str(path)!r}).write_text({broken!r})).start()
t0 = time.monotonic()
d = nv.nvmlEventSetWait_v2(s, 10000)
print(json.dumps([d.eventData, time.monotonic() - t0]))
""",
    )
    # woken by the event (after the config broke at 0.5 s), not by the wait's own 10 s timeout
    assert got[0] == 94 and 0.4 < got[1] < 10


def test_cuda_and_nvml_in_one_process(sim_env: dict[str, str]) -> None:
    """A process using both libraries: NVML sees its own CUDA memory and does not reap itself."""
    got = run_python(
        sim_env,
        """
import ctypes, os
cu = ctypes.CDLL("libcuda.so.1")
ctx, ptr = ctypes.c_void_p(), ctypes.c_ulonglong()
assert cu.cuInit(0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(123 << 20)) == 0
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
before = [nv.nvmlDeviceGetMemoryInfo(h).used, [[p.pid, p.usedGpuMemory] for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]]
assert cu.cuMemFree_v2(ptr) == 0
after = nv.nvmlDeviceGetMemoryInfo(h).used
print(json.dumps({"pid": os.getpid(), "before": before, "after": after}))
""",
    )
    mine = (123 << 20) + CONTEXT_MEMORY  # its allocation and its primary context
    assert got["before"] == [mine, [[got["pid"], mine]]]
    assert got["after"] == CONTEXT_MEMORY


def test_null_pointers_are_invalid_argument(sim_env: dict[str, str]) -> None:
    """Every NVML entry point given NULL where it writes answers NVML_ERROR_INVALID_ARGUMENT."""
    got = run_python(
        sim_env,
        """
import ctypes

lib = ctypes.CDLL("libnvidia-ml.so.1")
assert lib.nvmlInit_v2() == 0
h = ctypes.c_void_p()
assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == 0
N = None
calls = {
    "nvmlDeviceGetCount_v2": (N,), "nvmlDeviceGetHandleByIndex_v2": (0, N), "nvmlDeviceGetHandleByUUID": (N, N),
    "nvmlDeviceGetHandleByPciBusId_v2": (N, N), "nvmlDeviceGetName": (h, N, 96), "nvmlDeviceGetUUID": (h, N, 96),
    "nvmlDeviceGetIndex": (h, N), "nvmlDeviceGetMinorNumber": (h, N), "nvmlDeviceGetNumaNodeId": (h, N),
    "nvmlDeviceGetPciInfo_v3": (h, N), "nvmlDeviceGetCudaComputeCapability": (h, N, N),
    "nvmlDeviceGetBrand": (h, N),
    "nvmlDeviceGetMemoryInfo": (h, N), "nvmlDeviceGetMemoryInfo_v2": (h, N), "nvmlDeviceGetUtilizationRates": (h, N),
    "nvmlDeviceGetProcessUtilization": (h, N, N, ctypes.c_ulonglong(0)),
    "nvmlDeviceGetComputeRunningProcesses_v3": (h, N, N), "nvmlDeviceGetComputeRunningProcesses_v2": (h, N, N),
    "nvmlDeviceGetComputeRunningProcesses": (h, N, N), "nvmlDeviceGetGraphicsRunningProcesses_v3": (h, N, N),
    "nvmlDeviceGetSupportedEventTypes": (h, N), "nvmlEventSetCreate": (N,), "nvmlEventSetWait_v2": (N, N, 0),
    "nvmlDeviceRegisterEvents": (h, ctypes.c_ulonglong(8), N), "nvmlEventSetFree": (N,),
    "nvmlSystemGetDriverVersion": (N, 80), "nvmlSystemGetCudaDriverVersion": (N,),
    "nvmlSystemGetCudaDriverVersion_v2": (N,), "nvmlSystemGetNVMLVersion": (N, 80),
    "nvmlDeviceGetHandleByIndex": (0, N), "nvmlDeviceGetCount": (N,), "nvmlDeviceGetPciInfo": (h, N),
}
print(json.dumps({name: getattr(lib, name)(*args) for name, args in calls.items()}))
""",
    )
    assert got == {name: 2 for name in got}, {k: v for k, v in got.items() if v != 2}

"""What cuBLAS and cuBLASLt ask of the simulated driver at initialisation (docs/simulator.md,
'Device attributes and occupancy'): device attributes a real H100 reports, per-SM limits that
agree with the occupancy calculator, and the entry points cuBLASLt resolves with dlsym, each
answering as a GPU without the feature does."""

from __future__ import annotations

from tests.sim.simhelp import run_python

PROBE = """
import ctypes as C
cu = C.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
def attr(a):
    v = C.c_int(-7)
    assert cu.cuDeviceGetAttribute(C.byref(v), a, 0) == 0
    return v.value
names = {"regs_per_block": 12, "can_map_host": 19, "async_engines": 40, "smem_per_sm": 81,
         "regs_per_sm": 82, "smem_optin": 97, "blocks_per_sm": 106, "reserved_smem": 111,
         "cluster_launch": 120, "sms": 16}
out = {k: attr(a) for k, a in names.items()}
ctx = C.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(C.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
can = C.c_int(-1)
out["can_access_peer"] = (cu.cuDeviceCanAccessPeer(C.byref(can), 0, 0), can.value)
out["enable_peer"] = cu.cuCtxEnablePeerAccess(ctx, 0)
out["disable_peer"] = cu.cuCtxDisablePeerAccess(ctx)
p = C.c_uint64()
assert cu.cuMemAlloc_v2(C.byref(p), 64) == 0
assert cu.cuStreamWriteValue32(None, p, 5, 0) == 0
out["wait_geq_met"] = cu.cuStreamWaitValue32(None, p, 5, 0)
out["wait_eq_unmet"] = cu.cuStreamWaitValue32(None, p, 6, 1)
out["wait_bad_flags"] = cu.cuStreamWaitValue32(None, p, 5, 0x10)
# one write of 9 then a wait for >= 9, as cuStreamBatchMemOp's 48-byte records
ops = (C.c_uint8 * 96)()
C.c_uint32.from_buffer(ops, 0).value = 2  # WRITE_VALUE_32
C.c_uint64.from_buffer(ops, 8).value = p.value
C.c_uint64.from_buffer(ops, 16).value = 9
C.c_uint32.from_buffer(ops, 48).value = 1  # WAIT_VALUE_32
C.c_uint64.from_buffer(ops, 56).value = p.value
C.c_uint64.from_buffer(ops, 64).value = 9
out["batch"] = cu.cuStreamBatchMemOp(None, 2, ops, 0)
word = C.c_uint32()
assert cu.cuMemcpyDtoH_v2(C.byref(word), p, 4) == 0
out["word"] = word.value
out["prefetch"] = cu.cuMemPrefetchAsync(p, 64, 0, None)
out["prefetch_unknown"] = cu.cuMemPrefetchAsync(C.c_uint64(16), 64, 0, None)
kinds = (C.c_int * 2)(2, 9)  # MEMORY_TYPE, DEVICE_ORDINAL
mt, ordinal = C.c_uint(99), C.c_int(99)
data = (C.c_void_p * 2)(C.cast(C.byref(mt), C.c_void_p), C.cast(C.byref(ordinal), C.c_void_p))
out["ptr_attrs"] = (cu.cuPointerGetAttributes(2, kinds, data, p), mt.value, ordinal.value)
out["ptr_attrs_unknown"] = (cu.cuPointerGetAttributes(2, kinds, data, C.c_uint64(16)), mt.value)
print(json.dumps(out))
"""


def test_cublas_init_answers(sim_env: dict[str, str]) -> None:
    got = run_python(sim_env, PROBE)
    # H100 (compute capability 9.0): the programming guide's per-SM limits
    assert got["regs_per_block"] == got["regs_per_sm"] == 65536, got
    assert (got["smem_per_sm"], got["smem_optin"], got["reserved_smem"]) == (233472, 232448, 1024)
    assert got["blocks_per_sm"] == 32 and got["cluster_launch"] == 1, got
    assert got["can_map_host"] == 1 and got["async_engines"] > 0, got
    # no P2P path: cannot access, enabling unsupported (217), nothing to disable (705)
    assert got["can_access_peer"] == [0, 0], got
    assert (got["enable_peer"], got["disable_peer"]) == (217, 705), got
    # a wait whose condition holds passes; one that would stall is refused (801), bad flags 1
    assert (got["wait_geq_met"], got["wait_eq_unmet"], got["wait_bad_flags"]) == (0, 801, 1), got
    assert got["batch"] == 0 and got["word"] == 9, got
    assert (got["prefetch"], got["prefetch_unknown"]) == (0, 1), got
    assert got["ptr_attrs"] == [0, 2, 0], got  # device memory on device 0
    assert got["ptr_attrs_unknown"] == [0, 0], got  # an unknown pointer is "not device memory"

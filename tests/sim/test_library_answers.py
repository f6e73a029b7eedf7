"""What cuBLAS and cuBLASLt ask of the simulated driver (docs/simulator.md, 'Device attributes
and occupancy' and 'Fat binaries'): device attributes a real H100 reports, per-SM limits that
agree with the occupancy calculator, and the entry points cuBLASLt resolves with dlsym, each
answering as a GPU without the feature does; and libraries loaded as cuBLASLt loads the cubins of
its CUTLASS kernels (CU_LIBRARY_BINARY_IS_PRESERVED with no value array)."""

from __future__ import annotations

from pathlib import Path

from tests.sim.simhelp import run_python
from tests.support.cuda_modules import cubin

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


LIBRARY_OPTIONS = """
import ctypes as C
cu = C.CDLL("libcuda.so.1")
path = sys.argv[1]
assert cu.cuInit(0) == 0
ctx = C.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(C.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
image = C.create_string_buffer(open(path, "rb").read())
PRESERVED, HOST_TABLE = (C.c_int * 1)(1), (C.c_int * 1)(0)
out = {}
lib = C.c_void_p()
# cuBLASLt's call: the preserved flag with no value array
out["preserved_no_values"] = cu.cuLibraryLoadData(C.byref(lib), image, None, None, 0, PRESERVED, None, 1)
k, ptr, size = C.c_void_p(), C.c_uint64(), C.c_size_t()
out["kernel"] = cu.cuLibraryGetKernel(C.byref(k), lib, b"sim_10us")
out["global"] = (cu.cuLibraryGetGlobal(C.byref(ptr), C.byref(size), lib, b"big"), size.value)
out["unload"] = cu.cuLibraryUnload(lib)
vals = (C.c_void_p * 1)(None)
out["host_table_no_values"] = cu.cuLibraryLoadData(C.byref(lib), image, None, None, 0, HOST_TABLE, None, 1)
out["options_null"] = cu.cuLibraryLoadData(C.byref(lib), image, None, None, 0, None, vals, 1)
# a file's image is read during the call: it cannot be preserved
p = path.encode()
out["file_preserved"] = cu.cuLibraryLoadFromFile(C.byref(lib), p, None, None, 0, PRESERVED, None, 1)
out["file"] = cu.cuLibraryLoadFromFile(C.byref(lib), p, None, None, 0, None, None, 0)
print(json.dumps(out))
"""


def test_library_loaded_as_cublaslt_loads_its_cutlass_cubins(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    mod = cubin(tmp_path / "m.cubin", 1 << 20)
    got = run_python(sim_env, LIBRARY_OPTIONS.replace("sys.argv[1]", repr(str(mod))))
    # CU_LIBRARY_BINARY_IS_PRESERVED is a flag: no value array needed, and the library works
    assert got["preserved_no_values"] == 0, got
    assert got["kernel"] == 0 and got["global"] == [0, 1 << 20] and got["unload"] == 0, got
    # the host table option carries a pointer: without values, CUDA_ERROR_INVALID_VALUE (1)
    assert got["host_table_no_values"] == 1 and got["options_null"] == 1, got
    assert got["file_preserved"] == 1 and got["file"] == 0, got

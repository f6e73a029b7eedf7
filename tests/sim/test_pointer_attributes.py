"""cuPointerGetAttributes as NVIDIA's driver answers it (docs/simulator.md): the host address and
the managed flag of each kind of memory, and for a pointer the driver does not know (pageable
host memory: CuPy's `is_memory_pinned`, through cudaPointerGetAttributes) every attribute read as
"not device memory" with CUDA_SUCCESS, where cuPointerGetAttribute refuses."""

from __future__ import annotations

from tests.sim.simhelp import run_python

PROBE = """
import ctypes as C
cu = C.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
ctx = C.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(C.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
HOST_POINTER, IS_MANAGED, MEMORY_TYPE = 4, 8, 2
def attrs(ptr):
    kinds = (C.c_int * 3)(HOST_POINTER, IS_MANAGED, MEMORY_TYPE)
    host, managed, mt = C.c_void_p(7), C.c_int(7), C.c_uint(7)
    data = (C.c_void_p * 3)(*(C.cast(C.byref(v), C.c_void_p) for v in (host, managed, mt)))
    rc = cu.cuPointerGetAttributes(3, kinds, data, C.c_uint64(ptr))
    return [rc, host.value or 0, managed.value, mt.value]
def one(ptr, attr):
    v = C.c_uint64(7)
    return cu.cuPointerGetAttribute(C.byref(v), attr, C.c_uint64(ptr))
buf = C.create_string_buffer(4096)
dev, managed = C.c_uint64(), C.c_uint64()
assert cu.cuMemAlloc_v2(C.byref(dev), 1 << 20) == 0
assert cu.cuMemAllocManaged(C.byref(managed), 1 << 20, 1) == 0
pinned = C.c_void_p()
assert cu.cuMemAllocHost_v2(C.byref(pinned), 1 << 20) == 0
out = {"pageable": attrs(C.addressof(buf)), "device": attrs(dev.value),
       "managed": attrs(managed.value), "pinned": attrs(pinned.value),
       "one_device_host": one(dev.value, HOST_POINTER), "one_pageable": one(C.addressof(buf), IS_MANAGED),
       "addrs": [C.addressof(buf), dev.value, managed.value, pinned.value]}
print(json.dumps(out))
"""


def test_pointer_attributes_of_each_kind(sim_env: dict[str, str]) -> None:
    got = run_python(sim_env, PROBE)
    _, _, managed, pinned = got["addrs"]
    # rc, host pointer, is managed, memory type (0: none, 1: host, 2: device)
    assert got["pageable"] == [0, 0, 0, 0], got
    assert got["device"] == [0, 0, 0, 2], got
    assert got["managed"] == [0, managed, 1, 2], got
    assert got["pinned"] == [0, pinned, 0, 1], got
    # the single-attribute form refuses what the host cannot reach, and pointers it does not know
    assert got["one_device_host"] == 1 and got["one_pageable"] == 1, got

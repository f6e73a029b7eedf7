"""Tensor maps (shim/sim/cuda/tensormap.c): cuTensorMapEncodeTiled, cuTensorMapEncodeIm2col and
cuTensorMapReplaceAddress are exported and in the cuGetProcAddress table at CUDA 12.0, declared
as NVIDIA's cuda.h declares them (CUDA 12 and 13), and answer the documented rules of their
arguments: a valid tiled map of a bf16 matrix (what FlashAttention 3 encodes) is accepted and
its address replaced, each broken rule is CUDA_ERROR_INVALID_VALUE."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.sim.simhelp import run_python
from tests.support.nvidia_headers import cuda_include, cuda_includes

REPO = Path(__file__).resolve().parents[2]
INCLUDE = REPO / "shim" / "include"
SIM_CUDA = REPO / "shim" / "sim" / "cuda"


def _compile(tmp_path: Path, source: str, *flags: str) -> Path:
    src = tmp_path / "check.c"
    src.write_text(source)
    out = tmp_path / "check"
    r = subprocess.run(
        ["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", *flags, "-o", str(out), str(src)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("cuda", [12, 13])
def test_prototypes_match_cuda_h(tmp_path: Path, cuda: int) -> None:
    # re-declaring the simulator's prototypes after cuda.h is a compile error on any mismatch
    src = (
        "#include <cuda.h>\n#define VGPU_CHECK_AGAINST_CUDA_H 1\n"
        '#include "vgpu/cuda_api.h"\n#include "tensormap_api.h"\nint main(void) { return 0; }\n'
    )
    include = cuda_includes()[cuda - 12]
    _compile(
        tmp_path,
        src,
        "-D__CUDA_API_VERSION_INTERNAL",
        f"-I{include}",
        f"-I{INCLUDE}",
        f"-I{SIM_CUDA}",
    )


LAYOUT = """
#include <stdio.h>
%s
int main(void) {
    printf("%%zu %%zu %%d\\n", sizeof(CUtensorMap), _Alignof(CUtensorMap), CU_TENSOR_MAP_NUM_QWORDS);
    printf("%%d %%d %%d %%d %%d %%d\\n", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B,
           CU_TENSOR_MAP_INTERLEAVE_32B, CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
           CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA);
    return 0;
}
"""


def test_descriptor_and_enums_match_cuda_h(tmp_path: Path) -> None:
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    ours = _compile(
        tmp_path / "ours",
        LAYOUT % '#include "vgpu/cuda_api.h"\n#include "tensormap_api.h"',
        f"-I{INCLUDE}",
        f"-I{SIM_CUDA}",
    )
    theirs = _compile(tmp_path / "theirs", LAYOUT % "#include <cuda.h>", f"-I{cuda_include()}")
    a = subprocess.run([str(ours)], capture_output=True, text=True, check=True).stdout
    b = subprocess.run([str(theirs)], capture_output=True, text=True, check=True).stdout
    assert a == b and a.startswith("128 64 16\n"), (a, b)


PROBE = """
import ctypes as C
cu = C.CDLL("libcuda.so.1")
out = {}
u64, u32 = C.c_uint64, C.c_uint32
buf = (C.c_uint8 * 512)()
base = C.addressof(buf)
tmap = (base + 63) // 64 * 64           # a descriptor aligned to 64 bytes, as cuda.h's type is
def A(t, *v):
    return (t * len(v))(*v)
BF16, U8, I32, F32, U4_16B = 9, 0, 3, 7, 14
# a row-major bf16 matrix of 1000 x 4096, tiles of 64 x 64 (128-byte rows: the 128B swizzle)
def tiled(m=tmap, dtype=BF16, rank=2, addr=0x7f0000000000, dims=(4096, 1000), strides=(8192,),
          box=(64, 64), estr=(1, 1), interleave=0, swizzle=3, l2=2, oob=0):
    return cu.cuTensorMapEncodeTiled(
        C.c_void_p(m), dtype, rank, C.c_void_p(addr), A(u64, *dims), A(u64, *strides) if strides else None,
        A(u32, *box), A(u32, *estr), interleave, swizzle, l2, oob)
out["before_init"] = tiled()
assert cu.cuInit(0) == 0
out["valid"] = tiled()
first = bytes((C.c_uint8 * 128).from_address(tmap))
out["again_same"] = (tiled(), bytes((C.c_uint8 * 128).from_address(tmap)) == first)
out["deterministic_nonzero"] = any(first)
out["broken"] = {
    "null_map": tiled(m=0),
    "map_not_64_aligned": tiled(m=tmap + 16),
    "rank_0": tiled(rank=0),
    "rank_6": tiled(rank=6, dims=(64,) * 6, strides=(128,) * 5, box=(8,) * 6, estr=(1,) * 6),
    "interleave_rank_2": tiled(interleave=1, swizzle=0),
    "address_8_aligned": tiled(addr=0x7f0000000008),
    "dim_0": tiled(dims=(4096, 0)),
    "dim_above_2_32": tiled(dims=(4096, (1 << 32) + 1)),
    "stride_not_16": tiled(strides=(8200,)),
    "stride_2_40": tiled(strides=(1 << 40,)),
    "box_0": tiled(box=(64, 0)),
    "box_257": tiled(box=(64, 257), swizzle=0),
    "box_inner_not_16_bytes": tiled(box=(4, 64), swizzle=0),
    "inner_box_wider_than_swizzle": tiled(box=(128, 64)),
    "element_stride_9": tiled(estr=(1, 9)),
    "bad_type": tiled(dtype=16),
    "bad_swizzle": tiled(swizzle=7),
    "bad_l2": tiled(l2=4),
    "nan_fill_of_integers": tiled(dtype=I32, box=(32, 64), oob=1),
    "interleave_32_without_swizzle_32": tiled(
        rank=3, dims=(16, 64, 64), strides=(32, 2048), box=(16, 8, 8), estr=(1, 1, 1), interleave=2, swizzle=0),
    "packed_16b_box_not_128": tiled(dtype=U4_16B, dims=(4096, 1000), box=(64, 64), swizzle=0,
                                    addr=0x7f0000000000),
}
out["nan_fill_of_floats"] = tiled(dtype=F32, box=(32, 64), oob=1)
out["unswizzled_wide_box"] = tiled(box=(256, 8), swizzle=0)
out["rank_5"] = tiled(rank=5, dims=(64, 4, 4, 4, 4), strides=(128, 512, 2048, 8192), box=(64, 2, 2, 2, 2),
                      estr=(1, 1, 1, 1, 1), swizzle=0)
# cuTensorMapReplaceAddress: keeps everything but the address, which must stay aligned
assert tiled() == 0
before = bytes((C.c_uint8 * 128).from_address(tmap))
out["replace"] = cu.cuTensorMapReplaceAddress(C.c_void_p(tmap), C.c_void_p(0x7f0000100000))
after = bytes((C.c_uint8 * 128).from_address(tmap))
out["replace_changed_only_the_address"] = sum(x != y for x, y in zip(before, after)) in range(1, 9)
assert tiled(addr=0x7f0000100000) == 0
out["replace_equals_encoding_at_the_address"] = bytes((C.c_uint8 * 128).from_address(tmap)) == after
out["replace_misaligned"] = cu.cuTensorMapReplaceAddress(C.c_void_p(tmap), C.c_void_p(0x7f0000100008))
out["replace_null_map"] = cu.cuTensorMapReplaceAddress(None, C.c_void_p(0x7f0000100000))
# a copy of a descriptor is a descriptor (kernels get them by value)
copy = (base + 256 + 63) // 64 * 64
C.memmove(copy, tmap, 128)
out["replace_copy"] = cu.cuTensorMapReplaceAddress(C.c_void_p(copy), C.c_void_p(0x7f0000200000))
C.memset(copy, 0, 128)
out["replace_never_encoded"] = cu.cuTensorMapReplaceAddress(C.c_void_p(copy), C.c_void_p(0x7f0000200000))
# im2col: a 4-d NHWC tensor of bf16, 64 channels per pixel, 128 pixels per column
def im2col(rank=4, lower=(-1, -1), upper=(1, 1), cpp=64, ppc=128, swizzle=3):
    dims = (64, 32, 32, 8)[:rank] + (2,) * max(0, rank - 4)
    strides = (128, 4096, 131072, 1048576)[: rank - 1]
    return cu.cuTensorMapEncodeIm2col(
        C.c_void_p(tmap), BF16, rank, C.c_void_p(0x7f0000000000), A(u64, *dims), A(u64, *strides),
        A(C.c_int, *lower), A(C.c_int, *upper), cpp, ppc, A(u32, *(1,) * rank), 0, swizzle, 0, 0)
out["im2col"] = im2col()
out["im2col_broken"] = {
    "rank_2": im2col(rank=2, lower=(), upper=()),
    "corner_out_of_range": im2col(lower=(-129, 0)),
    "channels_0": im2col(cpp=0),
    "channels_257": im2col(cpp=257, swizzle=0),
    "pixels_1025": im2col(ppc=1025),
    "channels_wider_than_swizzle": im2col(cpp=128),
}
# the table: each at CUDA 12.0, none before
names = ["cuTensorMapEncodeTiled", "cuTensorMapEncodeIm2col", "cuTensorMapReplaceAddress"]
fn, qr = C.c_void_p(), C.c_int(-1)
out["procaddr"] = {}
for n in names:
    rc = cu.cuGetProcAddress_v2(n.encode(), C.byref(fn), 12000, 0, C.byref(qr))
    got = (rc, qr.value, fn.value is not None)
    rc_old = cu.cuGetProcAddress_v2(n.encode(), C.byref(fn), 11080, 0, C.byref(qr))
    out["procaddr"][n] = [*got, rc_old, qr.value, hasattr(cu, n)]
# the table's function is the exported one (through the driver's trampoline): it answers alike
cu.cuGetProcAddress_v2(b"cuTensorMapReplaceAddress", C.byref(fn), 12000, 0, C.byref(qr))
replace = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p)(fn.value)
assert tiled() == 0
out["via_table"] = (replace(tmap, 0x7f0000300000), replace(tmap, 0x7f0000300004))
print(json.dumps(out))
"""


def test_tensor_maps_follow_the_documented_rules(sim_env: dict[str, str]) -> None:
    got = run_python(sim_env, PROBE)
    assert got["before_init"] == 3, got  # CUDA_ERROR_NOT_INITIALIZED
    assert got["valid"] == 0, got
    assert got["again_same"] == [0, True] and got["deterministic_nonzero"], got
    assert {k: v for k, v in got["broken"].items() if v != 1} == {}, got["broken"]
    assert got["nan_fill_of_floats"] == 0 and got["unswizzled_wide_box"] == 0, got
    assert got["rank_5"] == 0, got
    assert got["replace"] == 0 and got["replace_changed_only_the_address"], got
    assert got["replace_equals_encoding_at_the_address"], got
    assert (got["replace_misaligned"], got["replace_null_map"]) == (1, 1), got
    assert (got["replace_copy"], got["replace_never_encoded"]) == (0, 1), got
    assert got["im2col"] == 0, got
    assert {k: v for k, v in got["im2col_broken"].items() if v != 1} == {}, got["im2col_broken"]
    # found at 12.0 (CUDA_SUCCESS, CU_GET_PROC_ADDRESS_SUCCESS); at 11.8 VERSION_NOT_SUFFICIENT (500, 2)
    for name, row in got["procaddr"].items():
        assert row == [0, 0, True, 500, 2, True], (name, row)
    assert got["via_table"] == [0, 1], got

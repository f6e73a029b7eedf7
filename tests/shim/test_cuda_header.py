"""Our CUDA declarations must match NVIDIA's cuda.h exactly: every prototype and struct layout.

The project builds without a CUDA toolkit, from shim/include/vgpu/cuda_api.h. A wrong prototype
would only show up on a real GPU, so we prove them here against the cuda.h of the pinned
nvidia-cuda-runtime-cu12 wheel (a test dependency: this check never skips).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.nvidia_headers import cuda_include, cuda_includes

REPO = Path(__file__).resolve().parents[2]
INCLUDE = REPO / "shim" / "include"

# Structs we define ourselves: their size and field offsets must equal cuda.h's.
LAYOUT_CHECKS = {
    "CUuuid": ["bytes"],
    "CUDA_ARRAY_DESCRIPTOR": ["Width", "Height", "Format", "NumChannels"],
    "CUDA_ARRAY3D_DESCRIPTOR": ["Width", "Height", "Depth", "Format", "NumChannels", "Flags"],
    "CUmemLocation": ["type", "id"],
    "CUmemAllocationProp": ["type", "requestedHandleTypes", "location", "allocFlags"],
    "CUmemAccessDesc": ["location", "flags"],
    "CUmemPoolProps": ["allocType", "handleTypes", "location", "maxSize", "usage"],
    "CUlaunchAttribute": ["id", "value"],
    "CUlaunchConfig": ["gridDimX", "blockDimZ", "sharedMemBytes", "hStream", "attrs", "numAttrs"],
    "CUexecAffinityParam": ["type", "param"],
    "CUctxCreateParams": ["execAffinityParams", "numExecAffinityParams", "cigParams"],
}

CONSTANTS = [
    "CUDA_SUCCESS",
    "CUDA_ERROR_INVALID_VALUE",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "CUDA_ERROR_NOT_INITIALIZED",
    "CUDA_ERROR_INVALID_CONTEXT",
    "CUDA_ERROR_NOT_FOUND",
    "CUDA_ERROR_NOT_READY",
    "CUDA_ERROR_INVALID_HANDLE",
    "CUDA_ERROR_NOT_SUPPORTED",
    "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
    "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
    "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
    "CU_DEVICE_ATTRIBUTE_PCI_BUS_ID",
    "CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID",
    "CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID",
    "CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED",
    "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
    "CU_AD_FORMAT_FLOAT",
    "CU_AD_FORMAT_HALF",
    "CU_AD_FORMAT_SIGNED_INT32",
    "CU_MEM_LOCATION_TYPE_DEVICE",
    "CU_MEM_ALLOCATION_TYPE_PINNED",
    "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED",
    "CU_MEMPOOL_ATTR_RELEASE_THRESHOLD",
    "CU_MEMPOOL_ATTR_USED_MEM_CURRENT",
    "CU_LAUNCH_ATTRIBUTE_COOPERATIVE",
    "CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM",
    "CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT",
    "CU_STREAM_CAPTURE_STATUS_ACTIVE",
    "CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL",
]


def _compile(tmp_path: Path, source: str, *flags: str) -> Path:
    src = tmp_path / "check.c"
    src.write_text(source)
    out = tmp_path / "check"
    res = subprocess.run(
        ["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", *flags, "-o", str(out), str(src)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    return out


def test_header_compiles_standalone(tmp_path: Path) -> None:
    _compile(tmp_path, '#include "vgpu/cuda_api.h"\nint main(void) { return 0; }\n', f"-I{INCLUDE}")


@pytest.mark.parametrize("cuda", [12, 13])
def test_every_prototype_matches_cuda_h(tmp_path: Path, cuda: int) -> None:
    # With __CUDA_API_VERSION_INTERNAL cuda.h declares every ABI name (legacy and versioned)
    # without renaming macros; re-declaring ours after it is a compile error on any mismatch.
    src = (
        "#include <cuda.h>\n#define VGPU_CHECK_AGAINST_CUDA_H 1\n"
        '#include "vgpu/cuda_api.h"\nint main(void) { return 0; }\n'
    )
    include = cuda_includes()[cuda - 12]
    _compile(tmp_path, src, "-D__CUDA_API_VERSION_INTERNAL", f"-I{include}", f"-I{INCLUDE}")


def _layout_program(include_line: str) -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", include_line, "int main(void) {"]
    for typ, fields in LAYOUT_CHECKS.items():
        lines.append(f'printf("sizeof {typ} %zu\\n", sizeof({typ}));')
        for f in fields:
            lines.append(f'printf("offsetof {typ}.{f} %zu\\n", offsetof({typ}, {f}));')
    for c in CONSTANTS:
        lines.append(f'printf("value {c} %lld\\n", (long long)({c}));')
    lines += ["return 0;", "}"]
    return "\n".join(lines) + "\n"


def test_struct_layouts_and_constants_match_cuda_h(tmp_path: Path) -> None:
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours_dir.mkdir()
    theirs_dir.mkdir()
    ours = _compile(ours_dir, _layout_program('#include "vgpu/cuda_api.h"'), f"-I{INCLUDE}")
    theirs = _compile(theirs_dir, _layout_program("#include <cuda.h>"), f"-I{cuda_include()}")
    a = subprocess.run([str(ours)], capture_output=True, text=True, check=True).stdout.splitlines()
    b = subprocess.run(
        [str(theirs)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    mismatches = [f"ours: {x} | cuda.h: {y}" for x, y in zip(a, b, strict=True) if x != y]
    assert not mismatches, "\n".join(mismatches)

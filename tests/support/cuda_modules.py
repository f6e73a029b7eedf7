"""CUDA module images with global variables to load through the simulated driver: PTX as NVRTC
or numba emit it, and an ELF cubin compiled by NVRTC."""

from __future__ import annotations

from pathlib import Path


def ptx(path: Path, big_bytes: int) -> Path:
    """A PTX module (as NVRTC or numba emit it) with one big and two small globals."""
    path.write_text(
        "//\n.version 8.0\n.target sm_80\n.address_size 64\n\n"
        f".visible .global .align 8 .b8 big[{big_bytes}];\n"
        ".visible .global .align 4 .u32 counter;\n"
        ".const .align 4 .b8 table[4096];\n"
        ".extern .global .align 4 .u32 elsewhere;\n\n"
        ".visible .entry sim_10us(\n\t.param .u64 p\n)\n{\n\t.local .align 4 .b8 scratch[64];\n\tret;\n}\n"
    )
    return path


def cubin(path: Path, big_bytes: int) -> Path:
    """The same variables in an ELF cubin, compiled by NVRTC (nvidia-cuda-nvrtc-cu12, a test
    dependency) as cuda.core and CuPy-style clients compile their kernels."""
    from cuda.bindings import nvrtc

    src = (
        f"__device__ char big[{big_bytes}];\n__device__ unsigned counter;\n"
        "__constant__ int table[1024];\n"
        'extern "C" __global__ void sim_10us(int *o) { o[0] = big[threadIdx.x] + table[0] + counter; }\n'
    ).encode()
    err, prog = nvrtc.nvrtcCreateProgram(src, b"m.cu", 0, [], [])
    opts = [b"--gpu-architecture=sm_90"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    err, n = nvrtc.nvrtcGetCUBINSize(prog)
    buf = b" " * n
    (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    path.write_bytes(buf)
    return path

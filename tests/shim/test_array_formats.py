"""The bytes per channel of each CUDA array format, in the shim and in the simulator, per NVIDIA's cuda.h.

The shim estimates an array's size from its format where the driver cannot say (shim/src/arrays.c),
and the simulator charges arrays by the same rule (shim/sim/cuda/arrays.c). Both read the format
numbers from one declaration (shim/include/vgpu/cuda_api.h), so a wrong number or size would agree
with itself and pass every test that runs the shim on the simulator. Here each `format_bytes` is
compiled on its own and asked about every format NVIDIA's cuda.h (CUDA 12 and 13) lists, by
NVIDIA's number: a plain format ("Unsigned 8-bit integers", "16-bit floating point") has the
bytes its comment says; every other one (normalized, packed, block-compressed, YUV) is 0, unknown,
which leaves the size to the driver rather than guessing it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.support.nvidia_headers import cuda_includes

REPO = Path(__file__).resolve().parents[2]
INCLUDE = REPO / "shim" / "include"
SOURCES = {
    "shim": REPO / "shim" / "src" / "arrays.c",
    "simulator": REPO / "shim" / "sim" / "cuda" / "arrays.c",
}
FUNCTION = re.compile(r"^static \w+ format_bytes\(CUarray_format f\) \{\n.*?^\}\n", re.M | re.S)
ENUM = re.compile(r"typedef enum CUarray_format_enum \{\n(.*?)\} CUarray_format;", re.S)
ENTRY = re.compile(
    r"^\s*(CU_AD_FORMAT_\w+)\s*=\s*(0x[0-9a-fA-F]+|\d+),?\s*(?:/\*\*<\s*(.*?)\s*\*/)?", re.M
)
PLAIN = re.compile(r"(?:Unsigned |Signed )?(8|16|32)-bit (?:integers|floating point)")


def nvidia_formats(include: Path) -> dict[str, tuple[int, int]]:
    """cuda.h's formats: name -> (number, bytes per channel; 0 where no plain size is stated)."""
    enum = ENUM.search((include / "cuda.h").read_text())
    assert enum, f"no CUarray_format in {include / 'cuda.h'}"
    formats = {}
    for name, number, comment in ENTRY.findall(enum.group(1)):
        if name == "CU_AD_FORMAT_MAX":
            continue
        plain = PLAIN.fullmatch(comment)
        formats[name] = (int(number, 0), int(plain.group(1)) // 8 if plain else 0)
    return formats


def test_nvidia_formats_are_read() -> None:
    """The parse finds the eight plain formats in both headers (an empty parse would pass vacuously)."""
    for include in cuda_includes():
        sized = {n for n, (_, b) in nvidia_formats(include).items() if b}
        assert sized == {
            "CU_AD_FORMAT_UNSIGNED_INT8",
            "CU_AD_FORMAT_UNSIGNED_INT16",
            "CU_AD_FORMAT_UNSIGNED_INT32",
            "CU_AD_FORMAT_SIGNED_INT8",
            "CU_AD_FORMAT_SIGNED_INT16",
            "CU_AD_FORMAT_SIGNED_INT32",
            "CU_AD_FORMAT_HALF",
            "CU_AD_FORMAT_FLOAT",
        }, include


@pytest.mark.parametrize("side", sorted(SOURCES))
def test_format_bytes_matches_cuda_h(tmp_path: Path, side: str) -> None:
    function = FUNCTION.search(SOURCES[side].read_text())
    assert function, f"{SOURCES[side]}: no `static ... format_bytes(CUarray_format f)` to check"
    formats: dict[str, tuple[int, int]] = {}
    for include in cuda_includes():
        formats.update(nvidia_formats(include))
    calls = "\n".join(
        f'    printf("%s %u\\n", "{name}", (unsigned)format_bytes((CUarray_format){number}));'
        for name, (number, _) in sorted(formats.items())
    )
    src = tmp_path / "formats.c"
    src.write_text(
        '#include <stdint.h>\n#include <stdio.h>\n#include "vgpu/cuda_api.h"\n\n'
        f"{function.group(0)}\nint main(void) {{\n{calls}\n    return 0;\n}}\n"
    )
    exe = tmp_path / "formats"
    built = subprocess.run(
        [
            "gcc",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{INCLUDE}",
            "-o",
            str(exe),
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = dict(line.split() for line in out.splitlines())
    wrong = {
        name: f"{side} says {got[name]}, cuda.h means {nbytes}"
        for name, (_, nbytes) in formats.items()
        if int(got[name]) != nbytes
    }
    assert not wrong, wrong

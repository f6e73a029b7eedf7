"""cffi build of the accounting-file binding: the layout comes from shim/include/vgpu/region.h."""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

_HEADER = Path(__file__).resolve().parent.parent / "shim" / "include" / "vgpu" / "region.h"


def _cdef_text() -> str:
    text = _HEADER.read_text()
    start = text.index("/* CFFI-BEGIN */") + len("/* CFFI-BEGIN */")
    end = text.index("/* CFFI-END */")
    return text[start:end]


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text())
ffibuilder.set_source(
    "sharing._region_cffi",
    '#include "vgpu/region.h"',
    include_dirs=[str(_HEADER.parent.parent)],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

"""cffi build of the accounting-file binding: the layout comes from shim/include/vgpu/region.h.

region.h embeds struct vgpu_compute_state (compute_state.h), so the CFFI part of compute_state.h
is fed to cffi first, then region.h's, then that of shim/src/enforced.h (what a set of settings
makes the shim enforce).
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

_INCLUDE = Path(__file__).resolve().parent.parent / "shim" / "include"
_SHIM_SRC = _INCLUDE.parent / "src"
_HEADERS = (
    _INCLUDE / "vgpu" / "compute_state.h",
    _INCLUDE / "vgpu" / "region.h",
    _SHIM_SRC / "enforced.h",
)


def _cffi_part(header: Path) -> str:
    text = header.read_text()
    start = text.index("/* CFFI-BEGIN */") + len("/* CFFI-BEGIN */")
    end = text.index("/* CFFI-END */")
    return text[start:end]


# The shim's own creation code (shim/src/region_init.c) compiled into the binding: one
# implementation of a new file's contents for the shim and for sharing.region.create(). And its
# check of the limits file (shim/src/limitkeys.c, vgpu/limits.def): one set of rules for the
# plugin's writer and the shim's reader. And its resolution of the settings into what it enforces
# (shim/src/enforced.c): `vgpu run` shows and records exactly what the shim will enforce. And the
# burst pool file's entries (shim/src/pool_io.c): the plugin writes them with the code the shim
# reads them with.
_HELPERS_CDEF = """
int vgpu_region_init(struct vgpu_region *r);
int vgpu_limits_check(char **entries, char *why, size_t len);
int vgpu_pool_init(struct vgpu_pool *p);
int vgpu_pool_check(const struct vgpu_pool *p, uint64_t size, char *why, size_t len);
void vgpu_pool_grant_write(struct vgpu_pool_grant *g, uint64_t key, uint32_t device, uint32_t state,
                           uint64_t request, uint64_t limit, uint64_t grant, uint64_t deadline_unix_ns);
void vgpu_pool_device_write(struct vgpu_pool_device *d, uint64_t capacity, uint64_t reserved,
                            uint64_t requested, uint64_t pool, uint64_t granted);
int vgpu_pool_grant_read(const struct vgpu_pool_grant *g, struct vgpu_pool_grant *out);
"""


def _cdef_text() -> str:
    return "\n".join(_cffi_part(h) for h in _HEADERS)


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text() + _HELPERS_CDEF)
ffibuilder.set_source(
    "sharing._region_cffi",
    '#include "region_init.h"\n#include "limitkeys.h"\n#include "enforced.h"\n#include "pool_io.h"',
    sources=[
        os.path.relpath(_SHIM_SRC / n)
        for n in ("region_init.c", "limitkeys.c", "enforced.c", "pool_io.c")
    ],
    include_dirs=[str(_INCLUDE), str(_SHIM_SRC)],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

"""cffi build of the accounting-file binding: the layout comes from shim/include/vgpu/region.h.

region.h embeds struct vgpu_compute_state (compute_state.h), so the CFFI part of compute_state.h
is fed to cffi first, then region.h's.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

_INCLUDE = Path(__file__).resolve().parent.parent / "shim" / "include"
_HEADERS = (_INCLUDE / "vgpu" / "compute_state.h", _INCLUDE / "vgpu" / "region.h")


def _cffi_part(header: Path) -> str:
    text = header.read_text()
    start = text.index("/* CFFI-BEGIN */") + len("/* CFFI-BEGIN */")
    end = text.index("/* CFFI-END */")
    return text[start:end]


# C helpers compiled into the binding: the robust process-shared mutex can only be initialised
# by pthreads itself (its bytes are the C library's business), so region.create() calls this.
_HELPERS_CDEF = """
int vgpu_region_init_lock(struct vgpu_region *r);
"""

_HELPERS_SOURCE = r"""
#include <pthread.h>
#include "vgpu/region.h"

static int vgpu_region_init_lock(struct vgpu_region *r) {
    pthread_mutexattr_t a;
    if (sizeof(pthread_mutex_t) > sizeof r->lock) return -1;
    if (pthread_mutexattr_init(&a) != 0) return -1;
    int rc = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    if (rc == 0) rc = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    if (rc == 0) rc = pthread_mutex_init((pthread_mutex_t *)(void *)r->lock, &a);
    pthread_mutexattr_destroy(&a);
    return rc == 0 ? 0 : -1;
}
"""


def _cdef_text() -> str:
    return "\n".join(_cffi_part(h) for h in _HEADERS)


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text() + _HELPERS_CDEF)
ffibuilder.set_source(
    "sharing._region_cffi",
    _HELPERS_SOURCE,
    include_dirs=[str(_INCLUDE)],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

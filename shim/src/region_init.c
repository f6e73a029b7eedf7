/*
 * The contents of a new accounting file: the one implementation, compiled into libvgpu.so (the
 * shim creates a slice's file on first use) and into the Python binding sharing._region_cffi
 * (`vgpu run`, the plugin and the tests create files ahead of the shim). Layout: vgpu/region.h.
 * Includes nothing of the shim's internals so that the binding can compile it alone.
 */
#include <stdatomic.h>
#include <time.h>

#include "vgpu/region.h"
#include "region_init.h"

/* r is freshly ftruncate()d, so all zeros (the lock word too: free): only the non-zero fields
 * are written (touching the whole 560 KiB would fault every page in, for nothing, in every racing
 * creator). */
int vgpu_region_init(struct vgpu_region *r) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r->header.created_unix_ns = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
    r->header.max_devices = VGPU_MAX_DEVICES;
    r->header.max_procs = VGPU_MAX_PROCS;
    r->header.file_size = sizeof *r;
    r->header.layout_version = VGPU_REGION_LAYOUT_VERSION;
    /* magic last: a reader that sees the magic sees a complete file (it is also link()ed only
     * when complete; this is belt and braces for the memfd case). */
    atomic_thread_fence(memory_order_release);
    r->header.magic = VGPU_REGION_MAGIC;
    return 0;
}

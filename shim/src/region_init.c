/*
 * The contents of a new accounting file: the one implementation, compiled into libvgpu.so (the
 * shim creates a slice's file on first use) and into the Python binding sharing._region_cffi
 * (`vgpu run`, the plugin and the tests create files ahead of the shim). Layout: vgpu/region.h.
 * Includes nothing of the shim's internals so that the binding can compile it alone.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "vgpu/region.h"
#include "region_init.h"

int vgpu_region_init_mutex(pthread_mutex_t *m) {
    pthread_mutexattr_t a;
    if (pthread_mutexattr_init(&a) != 0) return -1;
    int rc = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    if (rc == 0) rc = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    if (rc == 0) rc = pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    return rc == 0 ? 0 : -1;
}

/* r is freshly ftruncate()d, so all zeros: only the non-zero fields are written (touching the
 * whole 150 KiB would fault every page in, for nothing, in every racing creator). */
int vgpu_region_init(struct vgpu_region *r) {
    _Static_assert(sizeof(pthread_mutex_t) <= sizeof r->lock, "the region's lock word holds a pthread mutex");
    if (vgpu_region_init_mutex((pthread_mutex_t *)(void *)r->lock) != 0) return -1;
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

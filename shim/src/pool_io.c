/*
 * The burst pool file's entries under their sequence numbers (protocol: vgpu/region.h). Includes
 * nothing of the shim's internals so that the Python binding can compile it alone.
 *
 * Writer: seq odd (relaxed), release fence, the fields (relaxed atomic stores, each a single
 * aligned store), seq even (release). Reader: seq (acquire), retry while odd; the fields (relaxed
 * atomic loads); acquire fence; seq again: equal means the copy is one writer's whole entry.
 */
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "vgpu/region.h"
#include "pool_io.h"

#define READ_TRIES 10000 /* a writer holds an entry for a few stores; a descheduled one longer */
#define READ_SPINS 64
#define ST(p, v)   __atomic_store_n(&(p), (v), __ATOMIC_RELAXED)
#define LD(p)      __atomic_load_n(&(p), __ATOMIC_RELAXED)

int vgpu_pool_init(struct vgpu_pool *p) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    p->header.created_unix_ns = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
    p->header.max_devices = VGPU_MAX_DEVICES;
    p->header.max_grants = VGPU_POOL_MAX_GRANTS;
    p->header.file_size = sizeof *p;
    p->header.layout_version = VGPU_POOL_LAYOUT_VERSION;
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&p->header.magic, VGPU_POOL_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

int vgpu_pool_check(const struct vgpu_pool *p, uint64_t size, char *why, size_t len) {
    const char *bad = NULL;
    if (size != sizeof *p)
        bad = "wrong size (not a vgpu pool file of this layout)";
    else if (__atomic_load_n(&p->header.magic, __ATOMIC_ACQUIRE) != VGPU_POOL_MAGIC)
        bad = "wrong magic (not a vgpu pool file)";
    else if (p->header.layout_version != VGPU_POOL_LAYOUT_VERSION)
        bad = "another layout version";
    else if (p->header.file_size != sizeof *p || p->header.max_devices != VGPU_MAX_DEVICES ||
             p->header.max_grants != VGPU_POOL_MAX_GRANTS)
        bad = "header sizes disagree with the layout";
    if (bad != NULL) snprintf(why, len, "%s", bad);
    return bad != NULL ? -1 : 0;
}

static uint64_t begin_write(uint64_t *seq) {
    uint64_t s = __atomic_load_n(seq, __ATOMIC_RELAXED);
    s += s & 1 ? 0 : 1; /* odd: being written (a writer that died mid-entry left it odd) */
    __atomic_store_n(seq, s, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    return s;
}

static void end_write(uint64_t *seq, uint64_t odd) { __atomic_store_n(seq, odd + 1, __ATOMIC_RELEASE); }

void vgpu_pool_grant_write(struct vgpu_pool_grant *g, uint64_t key, uint32_t device, uint32_t state, uint64_t request,
                           uint64_t limit, uint64_t grant, uint64_t deadline_unix_ns) {
    uint64_t s = begin_write(&g->seq);
    ST(g->key, key);
    ST(g->device, device);
    ST(g->state, state);
    ST(g->request, request);
    ST(g->limit, limit);
    ST(g->grant, grant);
    ST(g->deadline_unix_ns, deadline_unix_ns);
    end_write(&g->seq, s);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the grant before the writer's next read (usage) */
}

void vgpu_pool_device_write(struct vgpu_pool_device *d, uint64_t capacity, uint64_t reserved, uint64_t requested,
                            uint64_t pool, uint64_t granted) {
    uint64_t s = begin_write(&d->seq);
    ST(d->capacity, capacity);
    ST(d->reserved, reserved);
    ST(d->requested, requested);
    ST(d->pool, pool);
    ST(d->granted, granted);
    end_write(&d->seq, s);
}

int vgpu_pool_grant_read(const struct vgpu_pool_grant *g, struct vgpu_pool_grant *out) {
    int rc = -1;
    for (int i = 0; i < READ_TRIES && rc != 0; i++) {
        uint64_t s1 = __atomic_load_n(&g->seq, __ATOMIC_ACQUIRE);
        if (!(s1 & 1)) {
            out->key = LD(g->key);
            out->device = LD(g->device);
            out->state = LD(g->state);
            out->request = LD(g->request);
            out->limit = LD(g->limit);
            out->grant = LD(g->grant);
            out->deadline_unix_ns = LD(g->deadline_unix_ns);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            out->seq = s1;
            if (__atomic_load_n(&g->seq, __ATOMIC_RELAXED) == s1) rc = 0;
        }
        if (rc != 0 && i >= READ_SPINS) sched_yield();
    }
    return rc;
}

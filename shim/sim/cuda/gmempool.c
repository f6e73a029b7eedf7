/*
 * Graph allocations and the per-device graph memory pool, behind the graph memory nodes
 * (graphmem.c), modelled on NVIDIA's driver:
 *
 *  - an allocation's virtual address is fixed when its node is created and stays valid across
 *    instantiations and launches; no device memory is taken then;
 *  - physical memory comes from the device's graph memory pool when the graph is launched: the
 *    launch reserves its peak (what its allocations need at once, net of the frees it runs) in
 *    pages of the device's allocation granularity, taking first what the pool already holds
 *    free; a launch that cannot get it fails with CUDA_ERROR_OUT_OF_MEMORY and runs nothing;
 *  - an allocation not freed in its graph lives on after the launch until cuMemFree,
 *    cuMemFreeAsync, a free node of another graph, or the next launch of an exec instantiated
 *    with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH; relaunching over an unfreed
 *    allocation otherwise fails with CUDA_ERROR_INVALID_VALUE;
 *  - freed graph memory stays reserved (charged: cuMemGetInfo and NVML count it) in the device's
 *    graph pool, whatever happens to the graph, until cuDeviceGraphMemTrim releases what no live
 *    allocation uses (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT / USED_MEM_CURRENT report both);
 *  - a graph holding memory nodes has at most one instantiation at a time.
 * Launches run at the call (graphexec.c), so "in use by a running graph" is "allocated, not freed".
 *
 * Locks: G.lock (the allocation table, the pool counters) is taken before gm_mu (the list of
 * graph allocations and their node references), which guards nothing else.
 */
#include "gmempool.h"

#include "init.h"
#include "memory.h"

#include "../common/state.h"

#include <stdlib.h>

static pthread_mutex_t gm_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sim_gmem *gms;
static uint64_t launch_seq;

static struct {
    uint64_t reserved, reserved_high, used, used_high;
} gpool[SIM_MAX_DEVICES]; /* G.lock */

static void unlink_release(struct sim_gmem *gm) /* gm_mu held */
{
    for (struct sim_gmem **pp = &gms; *pp; pp = &(*pp)->next)
        if (*pp == gm) {
            *pp = gm->next;
            break;
        }
    sim_backing_free((void *)gm->base, gm->size, gm->mmapped);
    free(gm);
}

void sim_gmem_ref(struct sim_gmem *gm) {
    pthread_mutex_lock(&gm_mu);
    gm->refs++;
    pthread_mutex_unlock(&gm_mu);
}

void sim_gmem_unref(struct sim_gmem *gm) {
    pthread_mutex_lock(&gm_mu);
    if (--gm->refs <= 0 && !gm->live) unlink_release(gm); /* no graph names it and nothing holds it: its address goes */
    pthread_mutex_unlock(&gm_mu);
}

static struct sim_gmem *lookup(CUdeviceptr p) /* gm_mu held */
{
    struct sim_gmem *gm = gms;
    while (gm && gm->base != (uintptr_t)p) gm = gm->next;
    return gm;
}

CUresult sim_gmem_new(int dev, size_t bytes, struct sim_gmem **out) {
    if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    if (bytes > (1ull << 52)) return CUDA_ERROR_OUT_OF_MEMORY;
    struct sim_gmem *gm = calloc(1, sizeof *gm);
    void *va = gm ? sim_backing_alloc(bytes, &gm->mmapped) : NULL; /* the address only: not charged */
    if (!va) {
        free(gm);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gm->base = (uintptr_t)va;
    gm->size = bytes;
    gm->pages = sim_align_up(bytes, G.alloc_gran);
    gm->dev = dev;
    pthread_mutex_lock(&gm_mu);
    gm->next = gms;
    gms = gm;
    pthread_mutex_unlock(&gm_mu);
    *out = gm;
    return CUDA_SUCCESS;
}

void sim_gmem_drop_unreferenced(struct sim_gmem *gm) {
    pthread_mutex_lock(&gm_mu);
    if (gm->refs <= 0 && !gm->live) unlink_release(gm);
    pthread_mutex_unlock(&gm_mu);
}

static void used_add(int dev, uint64_t b) /* G.lock held */
{
    gpool[dev].used += b;
    if (gpool[dev].used > gpool[dev].used_high) gpool[dev].used_high = gpool[dev].used;
}

/* An allocation is freed (free node, cuMemFree, auto-free). G.lock held. */
static void free_live_locked(struct sim_gmem *gm) {
    sim_alloc_remove(gm->base, NULL);
    gpool[gm->dev].used -= gm->pages < gpool[gm->dev].used ? gm->pages : gpool[gm->dev].used;
    pthread_mutex_lock(&gm_mu);
    gm->live = 0;
    if (gm->refs <= 0) unlink_release(gm); /* its graphs are gone: so is its address */
    pthread_mutex_unlock(&gm_mu);
}

CUresult sim_gmem_launch_prepare(const struct CUgraphExec_st *e) {
    pthread_mutex_lock(&G.lock);
    int auto_free = (e->flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0, any = 0;
    for (size_t i = 0; i < e->n; i++) {
        struct sim_gmem *gm = e->nodes[i].gm;
        if (e->nodes[i].type != NODE_MEM_ALLOC) continue;
        any = 1;
        if (gm->live && !auto_free) {
            pthread_mutex_unlock(&G.lock);
            return CUDA_ERROR_INVALID_VALUE; /* its previous launch's allocation is not freed */
        }
    }
    if (!any) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_SUCCESS;
    }
    for (size_t i = 0; i < e->n; i++)
        if (e->nodes[i].type == NODE_MEM_ALLOC && e->nodes[i].gm->live)
            free_live_locked(e->nodes[i].gm); /* AUTO_FREE_ON_LAUNCH */
    /* the launch's peak, per device: nodes run in order, a free returns its pages at once */
    uint64_t id = ++launch_seq, cur[SIM_MAX_DEVICES], peak[SIM_MAX_DEVICES];
    for (int d = 0; d < SIM_MAX_DEVICES; d++) cur[d] = peak[d] = gpool[d].used;
    for (size_t i = 0; i < e->n; i++) {
        struct sim_gmem *gm = e->nodes[i].gm;
        if (e->nodes[i].type == NODE_MEM_ALLOC) {
            gm->mark = id;
            cur[gm->dev] += gm->pages;
            if (cur[gm->dev] > peak[gm->dev]) peak[gm->dev] = cur[gm->dev];
        } else if (e->nodes[i].type == NODE_MEM_FREE && (gm->live || gm->mark == id)) {
            cur[gm->dev] -= gm->pages < cur[gm->dev] ? gm->pages : cur[gm->dev];
        }
    }
    int done = 0;
    CUresult rc = sim_ensure_slot() < 0 ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_SUCCESS;
    for (; rc == CUDA_SUCCESS && done < SIM_MAX_DEVICES; done++) {
        if (peak[done] <= gpool[done].reserved) continue;
        uint64_t more = peak[done] - gpool[done].reserved;
        if (sim_mem_charge(G.slot, sim_phys(done), more, G.cfg->dev[done].memory) != 0) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        gpool[done].reserved += more;
        if (gpool[done].reserved > gpool[done].reserved_high) gpool[done].reserved_high = gpool[done].reserved;
    }
    pthread_mutex_unlock(&G.lock);
    return rc; /* what earlier devices reserved stays in their pools, as the driver's would */
}

void sim_gmem_alloc_exec(struct sim_gmem *gm, struct CUctx_st *ctx) {
    pthread_mutex_lock(&G.lock);
    if (!gm->live) {
        sim_alloc a = {.base = gm->base,
                       .size = gm->size,
                       .charged = 0,
                       .dev = gm->dev,
                       .kind = ALLOC_GRAPH,
                       .mmapped = gm->mmapped,
                       .ctx = ctx};
        if (sim_alloc_insert(&a) == 0) { /* charged to the graph pool, not to the allocation */
            used_add(gm->dev, gm->pages);
            pthread_mutex_lock(&gm_mu);
            gm->live = 1;
            pthread_mutex_unlock(&gm_mu);
        }
    }
    pthread_mutex_unlock(&G.lock);
}

void sim_gmem_free_exec(struct sim_gmem *gm) {
    pthread_mutex_lock(&G.lock);
    if (gm->live) free_live_locked(gm);
    pthread_mutex_unlock(&G.lock);
}

/* cuMemFree of a graph allocation (memory.c hands it over). G.lock held. */
static void free_locked(const sim_alloc *a) {
    pthread_mutex_lock(&gm_mu);
    struct sim_gmem *gm = lookup(a->base);
    pthread_mutex_unlock(&gm_mu);
    if (gm && gm->live) free_live_locked(gm);
}

struct sim_gmem *sim_gmem_claim_free(CUdeviceptr p) {
    pthread_mutex_lock(&gm_mu);
    struct sim_gmem *gm = lookup(p);
    int ok = gm && !gm->free_node; /* an address an alloc node returned, freed in one graph only */
    if (ok) {
        gm->free_node = 1;
        gm->refs++; /* held across the node's creation */
    }
    pthread_mutex_unlock(&gm_mu);
    return ok ? gm : NULL;
}

void sim_gmem_unclaim_free(struct sim_gmem *gm) {
    pthread_mutex_lock(&gm_mu);
    gm->free_node = 0;
    pthread_mutex_unlock(&gm_mu);
}

__attribute__((constructor)) static void gmempool_ctor(void) { sim_alloc_set_release(ALLOC_GRAPH, free_locked); }

SIM_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device) {
    CUresult rc = sim_check_device(device);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    uint64_t spare = gpool[device].reserved - gpool[device].used;
    if (spare) {
        sim_mem_uncharge(G.slot, sim_phys(device), spare);
        gpool[device].reserved -= spare;
    }
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

static CUresult graph_mem_attr(CUdevice device, CUgraphMem_attribute attr, void *value, int set) {
    CUresult rc = sim_check_device(device);
    if (rc != CUDA_SUCCESS) return rc;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    cuuint64_t *v = value;
    pthread_mutex_lock(&G.lock);
    switch ((int)attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT:
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT:
        if (set)
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            *v = attr == CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT ? gpool[device].used : gpool[device].reserved;
        break;
    case CU_GRAPH_MEM_ATTR_USED_MEM_HIGH: /* setting resets the watermark (only 0 is allowed) */
        if (!set)
            *v = gpool[device].used_high;
        else if (*v)
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            gpool[device].used_high = gpool[device].used;
        break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH:
        if (!set)
            *v = gpool[device].reserved_high;
        else if (*v)
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            gpool[device].reserved_high = gpool[device].reserved;
        break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&G.lock);
    return rc;
}

SIM_EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value) {
    return graph_mem_attr(device, attr, value, 0);
}
SIM_EXPORT CUresult cuDeviceSetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value) {
    return graph_mem_attr(device, attr, value, 1);
}

/*
 * Graph memory nodes (cuGraphAddMemAllocNode / cuGraphAddMemFreeNode, and cuMemAllocAsync /
 * cuMemFreeAsync captured from a stream), modelled on NVIDIA's driver:
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
 * Launches run at the call (graph.c), so "in use by a running graph" is "allocated, not freed".
 *
 * Locks: G.lock (the allocation table, the pool counters) is taken before gm_mu (the list of
 * graph allocations and their node references), which guards nothing else.
 */
#include "cuda_internal.h"

#include <stdlib.h>

struct sim_gmem {
    uintptr_t base;
    size_t size;
    uint64_t pages; /* bytes of the graph pool it occupies while allocated */
    int dev;
    int mmapped;
    int refs;      /* graph and exec nodes that name it */
    int live;      /* allocated by a launch and not yet freed */
    int free_node; /* some graph holds a free node for it */
    uint64_t mark; /* launch_prepare: allocated earlier in this launch */
    struct sim_gmem *next;
};

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

static CUresult gmem_new(int dev, size_t bytes, struct sim_gmem **out) {
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

static void drop_unreferenced(struct sim_gmem *gm) /* a node was never made for it */
{
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

void sim_gmem_free_locked(const sim_alloc *a) {
    pthread_mutex_lock(&gm_mu);
    struct sim_gmem *gm = lookup(a->base);
    pthread_mutex_unlock(&gm_mu);
    if (gm && gm->live) free_live_locked(gm);
}

static CUresult check_deps(const CUgraphNode *deps, size_t n) {
    if (n && !deps) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < n; i++)
        if (!deps[i] || deps[i]->magic != MAGIC_NODE) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                           size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!phGraphNode || !nodeParams || !SIM_VALID(hGraph, MAGIC_GRAPH) ||
        check_deps(dependencies, numDependencies) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    const CUmemPoolProps *pp = &nodeParams->poolProps;
    if (pp->allocType != CU_MEM_ALLOCATION_TYPE_PINNED || pp->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        pp->handleTypes != CU_MEM_HANDLE_TYPE_NONE || sim_check_device(pp->location.id) != CUDA_SUCCESS ||
        (nodeParams->accessDescCount && !nodeParams->accessDescs) || nodeParams->accessDescCount > (size_t)G.cfg->ndev)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_gmem *gm;
    if ((rc = gmem_new(pp->location.id, nodeParams->bytesize, &gm)) != CUDA_SUCCESS) return rc;
    struct CUgraphNode_st tmpl = {.type = NODE_MEM_ALLOC, .bytes = nodeParams->bytesize, .dst = gm->base, .gm = gm};
    if (!(*phGraphNode = sim_graph_append(hGraph, &tmpl))) {
        drop_unreferenced(gm);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    nodeParams->dptr = (CUdeviceptr)gm->base;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                          size_t numDependencies, CUdeviceptr dptr) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!phGraphNode || !SIM_VALID(hGraph, MAGIC_GRAPH) || check_deps(dependencies, numDependencies) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&gm_mu);
    struct sim_gmem *gm = lookup(dptr);
    int ok = gm && !gm->free_node; /* an address an alloc node returned, freed in one graph only */
    if (ok) {
        gm->free_node = 1;
        gm->refs++; /* held across the append */
    }
    pthread_mutex_unlock(&gm_mu);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphNode_st tmpl = {.type = NODE_MEM_FREE, .dst = dptr, .gm = gm};
    rc = (*phGraphNode = sim_graph_append(hGraph, &tmpl)) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    if (rc != CUDA_SUCCESS) {
        pthread_mutex_lock(&gm_mu);
        gm->free_node = 0;
        pthread_mutex_unlock(&gm_mu);
    }
    sim_gmem_unref(gm);
    return rc;
}

static const struct CUgraphNode_st *node_of(CUgraphNode h, int type) {
    return h && h->magic == MAGIC_NODE && h->type == type ? h : NULL;
}

SIM_EXPORT CUresult cuGraphMemAllocNodeGetParams(CUgraphNode hNode, CUDA_MEM_ALLOC_NODE_PARAMS *params_out) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    const struct CUgraphNode_st *n = node_of(hNode, NODE_MEM_ALLOC);
    if (!n || !params_out) return CUDA_ERROR_INVALID_VALUE;
    *params_out = (CUDA_MEM_ALLOC_NODE_PARAMS){.bytesize = n->bytes, .dptr = n->dst};
    params_out->poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    params_out->poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    params_out->poolProps.location.id = n->gm->dev;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphMemFreeNodeGetParams(CUgraphNode hNode, CUdeviceptr *dptr_out) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    const struct CUgraphNode_st *n = node_of(hNode, NODE_MEM_FREE);
    if (!n || !dptr_out) return CUDA_ERROR_INVALID_VALUE;
    *dptr_out = n->dst;
    return CUDA_SUCCESS;
}

int sim_gmem_capture_alloc(struct CUstream_st *s, int dev, size_t bytes, CUdeviceptr *out, CUresult *rc) {
    pthread_mutex_lock(&s->mu);
    int capturing = s->capturing;
    pthread_mutex_unlock(&s->mu);
    if (!capturing) return 0;
    struct sim_gmem *gm;
    if ((*rc = gmem_new(dev, bytes, &gm)) != CUDA_SUCCESS) return 1;
    struct CUgraphNode_st tmpl = {.type = NODE_MEM_ALLOC, .bytes = bytes, .dst = gm->base, .gm = gm};
    CUdeviceptr base = (CUdeviceptr)gm->base;
    int captured = sim_capture_add(s, &tmpl);
    drop_unreferenced(gm);   /* not recorded (capture ended or invalidated): nothing refers to it */
    if (!captured) return 0; /* the capture ended meanwhile: an ordinary allocation */
    *out = base;
    return 1;
}

int sim_gmem_capture_free(struct CUstream_st *s, CUdeviceptr p, CUresult *rc) {
    pthread_mutex_lock(&s->mu);
    int capturing = s->capturing;
    pthread_mutex_unlock(&s->mu);
    if (!capturing) return 0;
    pthread_mutex_lock(&gm_mu);
    struct sim_gmem *gm = lookup(p);
    int ok = gm && !gm->free_node;
    if (ok) {
        gm->free_node = 1;
        gm->refs++;
    }
    pthread_mutex_unlock(&gm_mu);
    *rc = CUDA_SUCCESS;
    if (!ok) {
        /* a free node frees only graph allocations: the capture cannot record this one */
        pthread_mutex_lock(&s->mu);
        s->capture_invalid = 1;
        pthread_mutex_unlock(&s->mu);
        *rc = CUDA_ERROR_INVALID_VALUE;
        return 1;
    }
    struct CUgraphNode_st tmpl = {.type = NODE_MEM_FREE, .dst = p, .gm = gm};
    if (!sim_capture_add(s, &tmpl)) {
        pthread_mutex_lock(&gm_mu);
        gm->free_node = 0;
        pthread_mutex_unlock(&gm_mu);
        sim_gmem_unref(gm);
        return 0;
    }
    sim_gmem_unref(gm);
    return 1;
}

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

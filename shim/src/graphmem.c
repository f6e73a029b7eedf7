/*
 * Graph memory (memory alloc nodes: cuGraphAddMemAllocNode, and cuMemAllocAsync captured from a
 * stream) charged to the slice when the driver takes it.
 *
 * NVIDIA's driver fixes an allocation node's virtual address when the node is created and takes
 * physical memory for it only when the graph is launched (or uploaded), from the device's graph
 * memory pool, which keeps it after the allocation is freed until cuDeviceGraphMemTrim. So:
 *   - node creation and a captured cuMemAllocAsync are not charged (the driver takes nothing);
 *     on a capturing stream pools.c passes cuMemAllocAsync straight to the driver;
 *   - at instantiation the shim records the exec's allocation nodes (cuGraphGetNodes,
 *     cuGraphNodeGetType, cuGraphMemAllocNodeGetParams: the driver's answers), per device, each
 *     rounded up to the device's allocation granularity (cuMemGetAllocationGranularity);
 *   - at launch it charges what the exec's allocations need beyond what the device's graph pool
 *     holds free (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT - USED_MEM_CURRENT) before calling the
 *     driver (an AUTO_FREE_ON_LAUNCH exec's previous allocations are freed first, as the driver
 *     would, so that what they free counts); a launch the quota cannot hold is refused with CUDA_ERROR_OUT_OF_MEMORY and
 *     nothing runs; after the launch the device's charge settles to the pool's reserved bytes;
 *   - the charge goes back when the pool does: cuDeviceGraphMemTrim (hooked), and the refusal
 *     path and cuMemGetInfo settle (and the refusal path trims) the graph pool with the stream
 *     pools (reserve.c's settle functions), so memory a graph pool merely caches never causes an OOM.
 * An exec the shim did not see instantiated (cuGraphExecUpdate changing its nodes, a graph
 * uploaded with cuGraphUpload before its launch) cannot be refused beforehand: its launch is settled afterwards (charged, never refused).
 */
#include <pthread.h>
#include <stdlib.h>

#include "graphmem.h"
#include "devices.h"
#include "hooks.h"
#include "init.h"
#include "launch_hooks.h"
#include "region.h"
#include "reserve.h"
#include "symbols.h"

typedef CUresult (*graph_mem_attr_fn)(CUdevice, CUgraphMem_attribute, void *);
typedef CUresult (*get_nodes_fn)(CUgraph, CUgraphNode *, size_t *);
typedef CUresult (*node_type_fn)(CUgraphNode, CUgraphNodeType *);
typedef CUresult (*alloc_params_fn)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *);
typedef CUresult (*granularity_fn)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
typedef CUresult (*is_capturing_fn)(CUstream, CUstreamCaptureStatus *);
typedef CUresult (*free_params_fn)(CUgraphNode, CUdeviceptr *);

struct exec_rec {
    CUgraphExec exec;
    uint64_t need[VGPU_MAX_DEVICES]; /* bytes of its allocation nodes, per app device index */
    int auto_free;                   /* CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH */
    size_t nkept;                    /* its allocations not freed in the graph (auto_free only) */
    CUdeviceptr *kept;
    struct exec_rec *next;
};

static pthread_mutex_t exec_mu = PTHREAD_MUTEX_INITIALIZER;
#define EXEC_BUCKETS 256 /* a launch finds its exec without walking every exec of the process */
static struct exec_rec *execs[EXEC_BUCKETS];

static struct exec_rec **bucket(CUgraphExec e) {
    uintptr_t k = (uintptr_t)e;
    return &execs[(k >> 4 ^ k >> 12) % EXEC_BUCKETS];
}

static struct {
    pthread_mutex_t mu;
    int known; /* a graph allocation was seen on this device: dev is its CUdevice */
    CUdevice dev;
    uint64_t charged; /* bytes charged for the device's graph memory pool */
} gdev[VGPU_MAX_DEVICES];
static pthread_once_t gdev_once = PTHREAD_ONCE_INIT;

static void atfork_child(void) {
    /* the parent's execs and graph pools are not the child's (and their locks may be held) */
    pthread_mutex_init(&exec_mu, NULL);
    for (int i = 0; i < EXEC_BUCKETS; i++) execs[i] = NULL;
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        pthread_mutex_init(&gdev[i].mu, NULL);
        gdev[i].known = 0;
        gdev[i].charged = 0;
    }
}

static int graphmem_settle(int dev, int trim);

/* Once, at the first graph allocation seen: settled by reserve.c, forgotten in a fork child. */
static void gdev_init(void) {
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) pthread_mutex_init(&gdev[i].mu, NULL);
    pthread_atfork(NULL, NULL, atfork_child);
    vgpu_mem_add_settle(graphmem_settle);
}

static void *sym(void **cache, const char *name) {
    void *f = __atomic_load_n(cache, __ATOMIC_ACQUIRE);
    if (f == NULL) {
        f = vgpu_cuda_sym(name);
        __atomic_store_n(cache, f, __ATOMIC_RELEASE);
    }
    return f;
}

static graph_mem_attr_fn attr_fn(void) {
    static void *f;
    return (graph_mem_attr_fn)sym(&f, "cuDeviceGetGraphMemAttribute");
}

/* gdev[i].mu held: bring the device's charge to what its graph pool reserves now. */
static void settle_locked(int i) {
    cuuint64_t r = 0;
    graph_mem_attr_fn f = attr_fn();
    if (!gdev[i].known || f == NULL || f(gdev[i].dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &r) != CUDA_SUCCESS)
        return;
    uint64_t used;
    if (r < gdev[i].charged) {
        vgpu_mem_release(i, gdev[i].charged - r);
        gdev[i].charged = r;
    } else if (r > gdev[i].charged && vgpu_region_charge(i, r - gdev[i].charged, 0, &used) == 0) {
        gdev[i].charged = r; /* taken behind our back (an exec we did not see): account it */
    }
}

/* Settle device index dev's graph memory pool charge to what it reserves; trim it first if
 * trim. Nonzero if some charge was returned. */
static int graphmem_settle(int dev, int trim) {
    if (dev < 0 || dev >= VGPU_MAX_DEVICES) return 0;
    pthread_once(&gdev_once, gdev_init);
    if (pthread_mutex_trylock(&gdev[dev].mu) != 0) return 0; /* busy: its owner settles it */
    uint64_t before = gdev[dev].charged;
    if (trim && gdev[dev].known && real_cuDeviceGraphMemTrim) real_cuDeviceGraphMemTrim(gdev[dev].dev);
    settle_locked(dev);
    int released = gdev[dev].charged < before;
    pthread_mutex_unlock(&gdev[dev].mu);
    return released;
}

static void learn_device(int i, CUdevice d) {
    pthread_once(&gdev_once, gdev_init);
    pthread_mutex_lock(&gdev[i].mu);
    gdev[i].dev = d;
    gdev[i].known = 1;
    pthread_mutex_unlock(&gdev[i].mu);
}

/* The device's allocation granularity, as the driver reports it (1 if it cannot say). */
static uint64_t granule(CUdevice d) {
    static void *f;
    granularity_fn g = (granularity_fn)sym(&f, "cuMemGetAllocationGranularity");
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED};
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = d;
    size_t gr = 0;
    if (g == NULL || g(&gr, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || gr == 0) return 1;
    return gr;
}

static int has_ptr(const CUdeviceptr *v, size_t n, CUdeviceptr p) {
    for (size_t i = 0; i < n; i++)
        if (v[i] == p) return 1;
    return 0;
}

/* What the graph's allocation nodes take, per device. 0 if it has none (or cannot be read).
 * With r->auto_free, also the allocations no free node of the graph frees (r->kept). */
static int graph_needs(CUgraph g, uint64_t need[VGPU_MAX_DEVICES], struct exec_rec *r) {
    static void *fn_nodes, *fn_type, *fn_params, *fn_free;
    get_nodes_fn nodes_of = (get_nodes_fn)sym(&fn_nodes, "cuGraphGetNodes");
    node_type_fn type_of = (node_type_fn)sym(&fn_type, "cuGraphNodeGetType");
    alloc_params_fn params_of = (alloc_params_fn)sym(&fn_params, "cuGraphMemAllocNodeGetParams");
    size_t n = 0;
    if (nodes_of == NULL || type_of == NULL || params_of == NULL || nodes_of(g, NULL, &n) != CUDA_SUCCESS || n == 0)
        return 0;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    if (nodes == NULL || nodes_of(g, nodes, &n) != CUDA_SUCCESS) {
        free(nodes);
        return 0;
    }
    int any = 0;
    CUdeviceptr *freed = r->auto_free ? calloc(n, sizeof *freed) : NULL;
    size_t nfreed = 0;
    free_params_fn free_of = (free_params_fn)sym(&fn_free, "cuGraphMemFreeNodeGetParams");
    if (r->auto_free) r->kept = calloc(n, sizeof *r->kept);
    for (size_t k = 0; k < n; k++) {
        CUgraphNodeType t;
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        if (type_of(nodes[k], &t) != CUDA_SUCCESS) continue;
        if (t == CU_GRAPH_NODE_TYPE_MEM_FREE && freed && free_of && free_of(nodes[k], &freed[nfreed]) == CUDA_SUCCESS)
            nfreed++;
        if (t != CU_GRAPH_NODE_TYPE_MEM_ALLOC || params_of(nodes[k], &p) != CUDA_SUCCESS) continue;
        if (r->kept) r->kept[r->nkept++] = p.dptr;
        int i = vgpu_device_index(p.poolProps.location.id);
        if (i < 0) continue;
        uint64_t gr = granule(p.poolProps.location.id);
        need[i] += (p.bytesize + gr - 1) / gr * gr;
        learn_device(i, p.poolProps.location.id);
        any = 1;
    }
    if (r->kept) { /* those freed in the graph are not the launch's to free */
        size_t w = 0;
        for (size_t i = 0; i < r->nkept; i++)
            if (!has_ptr(freed, nfreed, r->kept[i])) r->kept[w++] = r->kept[i];
        r->nkept = w;
    }
    free(freed);
    free(nodes);
    return any;
}

static void record_exec(CUgraphExec e, CUgraph g, unsigned long long flags) {
    struct exec_rec *r = calloc(1, sizeof *r);
    if (r == NULL) return;
    r->exec = e;
    r->auto_free = (flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0;
    graph_needs(g, r->need, r); /* an exec without memory nodes is recorded too: its launches skip all this */
    pthread_mutex_lock(&exec_mu);
    struct exec_rec **b = bucket(e);
    r->next = *b;
    *b = r;
    pthread_mutex_unlock(&exec_mu);
}

/* 1 and its needs if the shim saw the exec instantiated; *kept (to free) the allocations an
 * AUTO_FREE_ON_LAUNCH exec's launch frees first. */
static int exec_needs(CUgraphExec e, uint64_t need[VGPU_MAX_DEVICES], CUdeviceptr **kept, size_t *nkept) {
    pthread_mutex_lock(&exec_mu);
    struct exec_rec *r = *bucket(e);
    while (r && r->exec != e) r = r->next;
    *kept = NULL;
    *nkept = 0;
    if (r) {
        for (int i = 0; i < VGPU_MAX_DEVICES; i++) need[i] = r->need[i];
        if (r->nkept && (*kept = malloc(r->nkept * sizeof **kept)) != NULL) {
            for (size_t i = 0; i < r->nkept; i++) (*kept)[i] = r->kept[i];
            *nkept = r->nkept;
        }
    }
    pthread_mutex_unlock(&exec_mu);
    return r != NULL;
}

static void forget_exec(CUgraphExec e) {
    pthread_mutex_lock(&exec_mu);
    struct exec_rec **pp = bucket(e), *r;
    while ((r = *pp) != NULL && r->exec != e) pp = &r->next;
    if (r) *pp = r->next;
    pthread_mutex_unlock(&exec_mu);
    if (r) free(r->kept);
    free(r);
}

/* Bytes the device's graph pool holds free: what a launch takes before reserving more. */
static uint64_t pool_spare(int i) {
    cuuint64_t r = 0, u = 0;
    graph_mem_attr_fn f = attr_fn();
    if (f == NULL || f(gdev[i].dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &r) != CUDA_SUCCESS ||
        f(gdev[i].dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &u) != CUDA_SUCCESS || u > r)
        return 0;
    return r - u;
}

static CUresult launch_memory(CUresult (*launch)(CUgraphExec, CUstream), CUgraphExec g, CUstream s, int ptsz) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    uint64_t need[VGPU_MAX_DEVICES] = {0};
    if (!vgpu_mem_active() || g == NULL) return launch(g, s);
    CUdeviceptr *kept;
    size_t nkept;
    int seen = exec_needs(g, need, &kept, &nkept), any = 0;
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) any |= need[i] != 0;
    if (seen && !any) return launch(g, s); /* no memory nodes: the common case costs one lookup */
    /* AUTO_FREE_ON_LAUNCH: the launch frees its previous allocations first, as cuMemFreeAsync on
     * its stream would. Do exactly that here, so that what the pool then holds free counts (an
     * allocation already freed just answers an error). */
    CUresult (*free_async)(CUdeviceptr, CUstream) = ptsz ? real_cuMemFreeAsync_ptsz : real_cuMemFreeAsync;
    for (size_t k = 0; k < nkept && free_async; k++) free_async(kept[k], s);
    free(kept);
    pthread_once(&gdev_once, gdev_init);
    int locked = 0; /* devices [0, locked) are locked, in index order */
    CUresult rc = CUDA_SUCCESS;
    for (; locked < VGPU_MAX_DEVICES; locked++) {
        int i = locked;
        pthread_mutex_lock(&gdev[i].mu);
        if (!need[i]) continue;
        settle_locked(i);
        uint64_t spare = pool_spare(i);
        uint64_t add = need[i] > spare ? need[i] - spare : 0;
        if (add && (rc = vgpu_mem_reserve(i, add)) != CUDA_SUCCESS) {
            /* the refusal path trimmed every other pool; this one (locked) is trimmed here */
            if (real_cuDeviceGraphMemTrim) real_cuDeviceGraphMemTrim(gdev[i].dev);
            settle_locked(i);
            add = need[i] > (spare = pool_spare(i)) ? need[i] - spare : 0;
            rc = add ? vgpu_mem_reserve(i, add) : CUDA_SUCCESS;
        }
        if (rc != CUDA_SUCCESS) {
            locked++;
            break;
        }
        gdev[i].charged += add;
    }
    if (rc == CUDA_SUCCESS) rc = launch(g, s);
    int cur = seen ? -1 : vgpu_current_device_index();
    for (int i = locked - 1; i >= 0; i--) {
        if (need[i] || i == cur) settle_locked(i); /* the pool's own figure: refused or failed, back to before */
        pthread_mutex_unlock(&gdev[i].mu);
    }
    return rc;
}

/* ---- instantiation: learn the exec's memory nodes ---- */

static CUresult instantiated(CUresult rc, CUgraphExec *e, CUgraph g, unsigned long long flags) {
    if (rc == CUDA_SUCCESS && e != NULL && vgpu_mem_active()) record_exec(*e, g, flags);
    return rc;
}

CUresult hook_cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer,
                                 size_t bufferSize) {
    VGPU_HOOK_OPEN(real_cuGraphInstantiate);
    return instantiated(real_cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize), phGraphExec,
                        hGraph, 0);
}

CUresult hook_cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer,
                                    size_t bufferSize) {
    VGPU_HOOK_OPEN(real_cuGraphInstantiate_v2);
    return instantiated(real_cuGraphInstantiate_v2(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize),
                        phGraphExec, hGraph, 0);
}

CUresult hook_cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags) {
    VGPU_HOOK_OPEN(real_cuGraphInstantiateWithFlags);
    return instantiated(real_cuGraphInstantiateWithFlags(phGraphExec, hGraph, flags), phGraphExec, hGraph, flags);
}

CUresult hook_cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph, CUDA_GRAPH_INSTANTIATE_PARAMS *p) {
    VGPU_HOOK_OPEN(real_cuGraphInstantiateWithParams);
    return instantiated(real_cuGraphInstantiateWithParams(phGraphExec, hGraph, p), phGraphExec, hGraph,
                        p ? p->flags : 0);
}

CUresult hook_cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                CUDA_GRAPH_INSTANTIATE_PARAMS *p) {
    VGPU_HOOK_OPEN(real_cuGraphInstantiateWithParams_ptsz);
    return instantiated(real_cuGraphInstantiateWithParams_ptsz(phGraphExec, hGraph, p), phGraphExec, hGraph,
                        p ? p->flags : 0);
}

CUresult hook_cuGraphExecDestroy(CUgraphExec hGraphExec) {
    VGPU_HOOK_OPEN(real_cuGraphExecDestroy);
    CUresult rc = real_cuGraphExecDestroy(hGraphExec);
    if (rc == CUDA_SUCCESS) forget_exec(hGraphExec); /* its memory stays in the graph pool until trimmed */
    return rc;
}

CUresult hook_cuDeviceGraphMemTrim(CUdevice device) {
    VGPU_HOOK_OPEN(real_cuDeviceGraphMemTrim);
    CUresult rc = real_cuDeviceGraphMemTrim(device);
    int i = vgpu_device_index(device);
    if (rc == CUDA_SUCCESS && vgpu_mem_active() && i >= 0) {
        learn_device(i, device);
        pthread_mutex_lock(&gdev[i].mu);
        settle_locked(i);
        pthread_mutex_unlock(&gdev[i].mu);
    }
    return rc;
}

/* ---- the compute cap's graph launch (launch_hooks.c) behind the memory check ---- */

CUresult hook_cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    return launch_memory(vgpu_launch_graph, hGraphExec, hStream, 0);
}

CUresult hook_cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    return launch_memory(vgpu_launch_graph_ptsz, hGraphExec, hStream, 1);
}

int vgpu_graphmem_capturing(CUstream s, int ptsz) {
    static void *f, *fp;
    is_capturing_fn is =
        (is_capturing_fn)(ptsz ? sym(&fp, "cuStreamIsCapturing_ptsz") : sym(&f, "cuStreamIsCapturing"));
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return is != NULL && is(s, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

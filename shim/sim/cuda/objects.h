/*
 * The simulated driver's objects: the structures behind its handles (contexts, streams, events,
 * modules, functions, graphs, arrays), their magic numbers, and small arithmetic helpers.
 * Every exported function validates its pointers (NULL -> CUDA_ERROR_INVALID_VALUE) and handles
 * (a magic number per object type plus the process generation, which fork bumps) before use.
 */
#ifndef VGPU_SIM_CUDA_OBJECTS_H
#define VGPU_SIM_CUDA_OBJECTS_H

#include "api.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

enum {
    MAGIC_DEAD = 0,
    MAGIC_CTX = 0x5c7c0001,
    MAGIC_STREAM,
    MAGIC_EVENT,
    MAGIC_MOD,
    MAGIC_FUNC,
    MAGIC_KERNEL,
    MAGIC_LIB,
    MAGIC_GRAPH,
    MAGIC_EXEC,
    MAGIC_POOL,
    MAGIC_ARRAY,
    MAGIC_MIPMAP,
    MAGIC_NODE,
};

#define SIM_PACE 1024 /* at most this many launches in flight per stream */

static inline uint64_t sim_align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
static inline uint64_t sim_max64(uint64_t a, uint64_t b) { return a > b ? a : b; }
static inline void sim_atomic_max(_Atomic uint64_t *p, uint64_t v) {
    uint64_t cur = atomic_load_explicit(p, memory_order_relaxed);
    while (cur < v && !atomic_compare_exchange_weak_explicit(p, &cur, v, memory_order_release, memory_order_relaxed)) {}
}

struct CUmemPoolHandle_st;

struct CUctx_st {
    uint32_t magic, gen;
    int dev;
    unsigned flags;
    int is_primary;
    int retain;                 /* primary: retain count */
    uint64_t serial;            /* unique per context ever created in the process */
    uint64_t charged;           /* context memory (SIMGPU_CONTEXT_MEMORY) */
    struct CUstream_st *legacy; /* the NULL stream */
    /* Work is tracked by lane positions (common/state.h, sched.c): the process's lane on the
     * context's device, cumulative device ns queued; done when the lane's served time reaches it. */
    _Atomic uint64_t tail_all;      /* end position of all work queued in the context */
    _Atomic uint64_t tail_blocking; /* end position of the legacy and the blocking streams' work */
    struct CUctx_st *next_free;
    size_t limits[CU_LIMIT_MAX]; /* cuCtxSetLimit values (ctxinfo.c) */
    unsigned char limit_set[CU_LIMIT_MAX];
    int cache_config;    /* cuCtxSetCacheConfig */
    struct sim_cls *cls; /* context-local storage (ctxstore.c) */
};

struct CUgraph_st;

struct CUstream_st {
    uint32_t magic, gen;
    struct CUctx_st *ctx;
    uint64_t ctx_serial; /* the context's serial at creation: dies with it */
    unsigned flags;
    int kind; /* STREAM_USER, STREAM_LEGACY, STREAM_PER_THREAD */
    int priority;
    pthread_mutex_t mu;      /* launches into one stream are ordered */
    _Atomic uint64_t tail;   /* end position of the last work queued in (or awaited by) the stream */
    uint64_t ends[SIM_PACE]; /* end positions of the last SIM_PACE launches (pacing) */
    unsigned pace_idx;
    uint64_t served_hint; /* the lane's served position when last seen (pacing) */
    int dep_dev;          /* cuStreamWaitEvent on another device's event: its lane ... */
    uint64_t dep_pos;     /* ... position (0: none); later work waits for it */
    /* stream capture */
    int capturing;
    int capture_invalid;
    CUstreamCaptureMode capture_mode;
    struct CUgraph_st *capture_graph;
    struct CUstream_st *next_free;
};
enum { STREAM_USER = 0, STREAM_LEGACY = 1, STREAM_PER_THREAD = 2 };

struct CUevent_st {
    uint32_t magic, gen;
    struct CUctx_st *ctx;
    uint64_t ctx_serial; /* dies with its context */
    unsigned flags;
    _Atomic uint64_t t;   /* CLOCK_MONOTONIC ns at which the recorded work completed, 0: not known yet */
    _Atomic uint64_t pos; /* lane position of the recorded work (lane: dev, this process) */
    int dev;              /* physical device of the lane */
    _Atomic int recorded;
};

struct CUfunc_st {
    uint32_t magic;
    uint64_t us_per_wave;
    int dur_arg; /* 1 + the parameter holding ns per wave (sim_arg<K>ns, argdur.c), 0: none */
    char *name;
    struct CUfunc_st *next;
    struct CUmod_st *mod;    /* NULL for a library kernel */
    int max_dyn_smem;        /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES */
    int carveout;            /* CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT */
    int cache_config;        /* CUfunc_cache */
    int nonportable_cluster; /* CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED */
};

struct CUkern_st {
    struct CUfunc_st fn; /* first: a CUkernel may be passed where a CUfunction goes */
    struct CUkern_st *next;
    struct CUlib_st *lib; /* the library it came from */
};

struct CUmod_global {
    char *name;
    CUdeviceptr ptr;
    size_t size;
};

struct CUmod_st {
    uint32_t magic, gen;
    struct CUfunc_st *funcs;
    struct CUctx_st *ctx;
    uint64_t ctx_serial;          /* dies with its context */
    struct CUmod_global *globals; /* from the image's PTX .global declarations */
    size_t nglobals;
};

struct CUlib_st {
    uint32_t magic, gen;
    struct CUkern_st *kernels;
    struct CUmod_st *mod; /* its globals, in the context current at load (or NULL) */
    const void *fatbin;   /* a fat binary's globals are found at the first lookup (fatbin.c) */
    void *fatbin_copy;    /* the copy kept when the caller did not promise to keep it */
    int fatbin_parsed;
};

enum { NODE_KERNEL = 1, NODE_MEMCPY, NODE_MEMSET, NODE_MEM_ALLOC, NODE_MEM_FREE };
struct sim_gmem;
struct CUgraphNode_st {
    uint32_t magic;
    int type;
    uint64_t dur_ns;      /* kernel */
    CUdeviceptr dst;      /* memcpy / memset destination */
    const void *src_host; /* memcpy source when host memory */
    CUdeviceptr src;      /* memcpy source when device memory */
    size_t bytes;         /* memcpy bytes / memset element count */
    unsigned value;
    int elem;            /* memset element size 1 or 4 */
    struct sim_gmem *gm; /* memory alloc / free node: the graph allocation (gmempool.c) */
    struct CUgraphNode_st *next;
};

struct CUgraph_st {
    uint32_t magic, gen;
    size_t n;
    struct CUgraphNode_st *head, *tail;
    int has_mem;            /* holds memory alloc / free nodes: one instantiation at a time */
    int nexec;              /* live instantiations */
    struct sim_uref *urefs; /* user object references it holds (userobj.c) */
};

struct CUgraphExec_st {
    uint32_t magic, gen;
    size_t n;
    struct CUgraphNode_st *nodes; /* a private copy: the graph may change or die */
    struct CUgraph_st *graph;     /* instantiated from (kept: graph structs are never freed) */
    unsigned long long flags;     /* CUDA_GRAPH_INSTANTIATE_FLAG_* */
    struct sim_uref *urefs;       /* its graph's user object references, retained at instantiation */
};

struct CUarray_st {
    uint32_t magic, gen;
    int dev;
    uint64_t charged;
    uint64_t required; /* CUDA_ARRAY3D_DEFERRED_MAPPING: what it needs (charged 0); else 0 */
};

struct CUmipmappedArray_st {
    uint32_t magic, gen;
    int dev;
    uint64_t charged;
    uint64_t required; /* as for arrays */
};

#endif

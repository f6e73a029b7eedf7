/*
 * Internals of the simulated libcuda.so.1 (shared between the files of shim/sim/cuda).
 *
 *   init.c     cuInit, cuDriverGetVersion, process globals, fork handling
 *   device.c   devices and attributes
 *   peer.c     peer access (no P2P path between the simulated GPUs)
 *   smlimits.c per-SM resource limits of a compute capability (attributes, occupancy)
 *   context.c  primary and explicit contexts, the per-thread context stack
 *   memory.c   the allocation table, cuMemAlloc & co, cuMemGetInfo, host memory, pointer queries
 *   copy.c     memcpy / memset, sync and async
 *   pools.c    stream-ordered allocator and memory pools
 *   vmm.c      virtual memory management (cuMemCreate, cuMemMap, ...)
 *   arrays.c   CUDA arrays (charged by a documented size formula)
 *   module.c   modules, libraries, kernels, functions
 *   launch.c   kernel launches: the device timeline
 *   stream.c   streams, synchronisation, events
 *   graph.c    stream capture and graphs
 *   graphnode.c kernel-node parameters (not kept: refused)
 *   procaddr.c cuGetProcAddress from vgpu/cuda_procaddr.def
 *   errors.c   error names and strings
 *
 * Every exported function validates its pointers (NULL -> CUDA_ERROR_INVALID_VALUE) and handles
 * (a magic number per object type plus the process generation, which fork bumps) before use.
 */
#ifndef VGPU_SIM_CUDA_INTERNAL_H
#define VGPU_SIM_CUDA_INTERNAL_H

/* Exported, but bound inside this library ("protected"): the simulator never calls its own
 * entry points through the dynamic symbol table, so an interposer (LD_PRELOAD) sees exactly the
 * application's calls, and cuGetProcAddress returns this library's own functions, as the real
 * driver does. */
#define SIM_EXPORT    __attribute__((visibility("protected")))
#define VGPU_CUDA_API extern SIM_EXPORT
#include "vgpu/cuda_api.h"
#include "sim_api_ext.h"
#include "../common/sim_common.h"

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

#define SIM_ALLOC_ALIGN     512ull                  /* cuMemAlloc & co charge sizes rounded up to this */
#define SIM_VMM_GRANULARITY (G.alloc_gran)          /* cuMemCreate / cuMemAddressReserve granularity (the page size) */
#define SIM_ARRAY_GRANULE   (2ull << 20)            /* arrays are charged in whole 2 MiB granules */
#define SIM_PITCH_ALIGN     (sim_pitch_alignment()) /* cuMemAllocPitch / array row pitch alignment */
uint64_t sim_pitch_alignment(void);                 /* SIMGPU_PITCH_ALIGNMENT, checked (arrays.c) */
#define SIM_PACE 1024                               /* at most this many launches in flight per stream */

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
    /* Work is tracked by lane positions (sim_common.h, sched.c): the process's lane on the
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
    struct sim_gmem *gm; /* memory alloc / free node: the graph allocation (graphmem.c) */
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

/* ---------------------------------------------------------------- process globals (init.c) */
typedef struct {
    pthread_mutex_t lock; /* guards every process-local registry below */
    _Atomic int initialized;
    const sim_config *cfg;   /* immutable once published: a re-read publishes a new one */
    int slot;                /* node state slot, -1 until the first context */
    _Atomic uint32_t gen;    /* bumped in a forked child: parent handles become invalid */
    uint64_t ctx_mem;        /* SIMGPU_CONTEXT_MEMORY */
    uint64_t alloc_gran;     /* SIMGPU_ALLOC_GRANULARITY: device memory page size */
    uint64_t launch_cost_ns; /* SIMGPU_LAUNCH_COST_NS: host CPU time of a launch */
    uint64_t queue_ahead_ns; /* SIMGPU_QUEUE_AHEAD_US */
    uint64_t ctx_serial;
    int live_contexts;
    struct CUctx_st *primary[SIM_MAX_DEVICES];
    struct CUmemPoolHandle_st *default_pool[SIM_MAX_DEVICES];
    struct CUmemPoolHandle_st *current_pool[SIM_MAX_DEVICES];
} sim_globals;
extern sim_globals G;

/* The node-wide state is indexed by physical device; CUDA ordinals by visible device. */
static inline int sim_phys(int dev) { return G.cfg->phys[dev]; }
static inline uint32_t sim_gen(void) { return atomic_load_explicit(&G.gen, memory_order_relaxed); }
#define SIM_VALID(obj, mg) ((obj) != NULL && (obj)->magic == (mg) && (obj)->gen == sim_gen())
/* A handle of a context lives only as long as that context: destroyed, or a primary context
 * reset (re-activated with a new serial), its streams, events and modules are invalid. */
#define SIM_OWNED_VALID(obj, mg)                                                                                       \
    (SIM_VALID(obj, mg) && SIM_VALID((obj)->ctx, MAGIC_CTX) && (obj)->ctx->serial == (obj)->ctx_serial)

CUresult sim_check_init(void);           /* CUDA_ERROR_NOT_INITIALIZED before cuInit */
CUresult sim_check_device(CUdevice dev); /* also checks init */
int sim_ensure_slot(void);               /* claim the node slot (under G.lock); -1 on failure */

/* context.c */
struct CUctx_st *sim_current_ctx(void);
CUresult sim_get_ctx(struct CUctx_st **out); /* current context or CUDA_ERROR_INVALID_CONTEXT */
void sim_contexts_after_fork(void);

/* ctxstore.c: context-local storage of the runtime's private table */
const void *sim_ctxstore_table(void);
void sim_ctxstore_end(struct CUctx_st *c); /* run the destructors: the context ends (no lock held) */

/* integrity.c */
void sim_md2(const void *data, size_t len, unsigned char out[16]);
void sim_integrity_digest(uint32_t version, uint64_t unix_seconds, uint32_t driver_version, uint32_t pid,
                          uint32_t thread, const void *cudart_table, const void *integrity_table, const void *check_fn,
                          uint64_t out[2]);

/* stream.c */
/* Resolve a stream handle (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or a created stream);
 * `ptds`: the per-thread-default-stream variant of the API is being called. */
CUresult sim_resolve_stream(CUstream h, int ptds, struct CUstream_st **out);
struct CUstream_st *sim_stream_new(struct CUctx_st *ctx, int kind, unsigned flags, int priority);
void sim_stream_release(struct CUstream_st *s);
/* Queue dur_ns of device time on the stream (the process's lane of the device); paces the caller. */
void sim_stream_enqueue(struct CUstream_st *s, uint64_t dur_ns);
uint64_t sim_stream_sync_target(struct CUstream_st *s); /* lane position when all work the stream waits for is done */
void sim_stream_drain(struct CUstream_st *s);           /* sleep until then (no capture check) */
void sim_lane_wait(struct CUctx_st *ctx, uint64_t pos); /* sleep until the context's lane reaches pos */
CUresult sim_stream_wait(struct CUstream_st *s);        /* host-blocking sync on a stream */
/* simulator-only ground truth of a process's device time (stream.c; found by dlsym) */
__attribute__((visibility("protected"))) CUresult simgpuProcessBusyNs(CUdevice dev, unsigned long long from_ns,
                                                                      unsigned long long to_ns,
                                                                      unsigned long long *busy_ns,
                                                                      unsigned long long *window_ns);
/* launch.c: a kernel's duration drawn around its modelled mean (SIMGPU_KERNEL_SPREAD_PCT, ...) */
uint64_t sim_kernel_sample_ns(uint64_t mean_ns);
void sim_after_sync(struct CUctx_st *ctx); /* pools release memory at synchronisation */
void sim_stream_fork_prepare(void);
void sim_stream_fork_parent(void);
void sim_stream_fork_child(void);

/* memory.c: the allocation table */
enum {
    ALLOC_DEVICE = 1,
    ALLOC_MANAGED,
    ALLOC_HOST,
    ALLOC_POOL,
    ALLOC_VMM_MAP,
    ALLOC_HOST_REGISTERED,
    ALLOC_MODULE,
    ALLOC_GRAPH
};
typedef struct {
    uintptr_t base;
    size_t size;      /* usable bytes */
    uint64_t charged; /* bytes charged on the device (0 for host / VMM maps) */
    int dev;
    int kind;
    int mmapped;    /* backing from mmap (else malloc) */
    int accessible; /* VMM maps: cuMemSetAccess done */
    struct CUctx_st *ctx;
    struct CUmemPoolHandle_st *pool;
    unsigned host_flags;                 /* cuMemHostAlloc / cuMemHostRegister flags */
    int small;                           /* sub-allocated from shared pages (charged bytes: its share) */
    CUmemGenericAllocationHandle handle; /* VMM maps: the handle mapped */
} sim_alloc;
int sim_alloc_insert(const sim_alloc *a);              /* G.lock held */
int sim_alloc_remove(uintptr_t base, sim_alloc *out);  /* exact base; G.lock held */
int sim_alloc_find(uintptr_t p, sim_alloc *out);       /* containing p; G.lock held */
int sim_alloc_overlaps(uintptr_t b, size_t n);         /* any entry meets [b, b+n); G.lock held */
int sim_range_meets_allocation(uintptr_t b, size_t n); /* the same, taking G.lock */
void *sim_backing_alloc(size_t size, int *mmapped);
uint64_t sim_alloc_granularity_knob(void); /* SIMGPU_ALLOC_GRANULARITY, checked */
uint64_t sim_context_memory_knob(void);    /* SIMGPU_CONTEXT_MEMORY (default 500 MiB) */
/* Allocate (and charge, unless host memory) in the current context; G.lock is taken inside. */
CUresult sim_alloc_memory(CUdeviceptr *out, size_t size, int kind, unsigned host_flags);
/* Release one allocation's backing and charge (registered host memory: only the record). */
void sim_alloc_release_locked(const sim_alloc *a);
void sim_backing_free(void *p, size_t size, int mmapped);
/* Is [p, p+n) inside one allocation the device may access (device, managed, pool, mapped VMM)? */
CUresult sim_check_device_range(CUdeviceptr p, size_t n);
CUresult sim_free_ctx_allocations(struct CUctx_st *ctx); /* context destroy */

/* pools.c */
CUresult sim_pool_alloc(struct CUmemPoolHandle_st *pool, size_t bytes, CUdeviceptr *out, struct CUctx_st *ctx);
void sim_pool_free_block(const sim_alloc *a); /* back into its pool (reserved); G.lock held */
void sim_pools_trim_device(int dev);          /* to their release thresholds */

/* copy.c */
CUresult sim_copy_exec(CUdeviceptr dst, const void *src_host, CUdeviceptr src, void *dst_host, size_t n);
CUresult sim_memset_exec(CUdeviceptr dst, unsigned value, size_t n, int elem);

/* module.c */
struct CUfunc_st *sim_func_resolve(CUfunction f); /* a function or a kernel; NULL if invalid */
/* Scan a PTX image (text) for .global variables; each is allocated (charged) in the module's
 * context. Returns CUDA_SUCCESS for images without any (cubins, fatbins). */
CUresult sim_module_globals(struct CUmod_st *m, const void *image);

/* fatbin.c */
const unsigned char *
sim_fatbin_header(const void *image);            /* the container of a fat binary (or its wrapper), else NULL */
size_t sim_fatbin_size(const unsigned char *fb); /* header and entries, in bytes */
unsigned char *sim_fatbin_cubin(const void *image,
                                int sm); /* the ELF cubin for SM `sm` (malloc'ed, NUL-ended), or NULL */
CUresult sim_module_globals_fatbin(struct CUmod_st *m, const void *image, int sm);

/* launch.c */
uint64_t sim_kernel_ns(const struct CUfunc_st *f, uint64_t blocks, int dev);
/* argdur.c: kernels named sim_arg<K>ns run, per wave, the ns in their parameter K */
int sim_dur_arg_of_name(const char *name);
uint64_t sim_arg_kernel_ns(const struct CUfunc_st *f, void **params, uint64_t blocks, int dev);

/* graph.c */
int sim_capture_add(struct CUstream_st *s, const struct CUgraphNode_st *tmpl); /* 1 if captured */
/* Append a copy of tmpl to g (a memory node takes a reference on its allocation); NULL: no memory. */
struct CUgraphNode_st *sim_graph_append(struct CUgraph_st *g, const struct CUgraphNode_st *tmpl);

/* userobj.c: user object references held by graphs and execs */
struct sim_uref;
void sim_urefs_copy(const struct CUgraph_st *g, struct sim_uref **to);
void sim_urefs_release(struct sim_uref **list);

/* graphmem.c: graph memory nodes and the per-device graph memory pool */
void sim_gmem_ref(struct sim_gmem *gm);   /* one more graph / exec node refers to it */
void sim_gmem_unref(struct sim_gmem *gm); /* the graph or exec holding the node died */
/* Before a launch executes the exec's nodes: free what AUTO_FREE_ON_LAUNCH frees, refuse a
 * relaunch over unfreed allocations, reserve the launch's peak in the device's graph pool. */
CUresult sim_gmem_launch_prepare(const struct CUgraphExec_st *e);
void sim_gmem_alloc_exec(struct sim_gmem *gm, struct CUctx_st *ctx); /* an alloc node runs */
void sim_gmem_free_exec(struct sim_gmem *gm);                        /* a free node runs */
void sim_gmem_free_locked(const sim_alloc *a);                       /* cuMemFree of a graph allocation; G.lock held */
/* cuMemAllocAsync / cuMemFreeAsync on a capturing stream become alloc / free nodes: 1 if so
 * (*rc then holds the result), 0 if the stream is not capturing. */
int sim_gmem_capture_alloc(struct CUstream_st *s, int dev, size_t bytes, CUdeviceptr *out, CUresult *rc);
int sim_gmem_capture_free(struct CUstream_st *s, CUdeviceptr p, CUresult *rc);

/* Per-SM resource limits of a compute capability (smlimits.c). */
typedef struct {
    int threads, blocks, regs; /* per SM */
    int smem;                  /* shared memory per SM, bytes */
    int smem_optin;            /* shared memory one block may opt in to */
    int smem_reserved;         /* shared memory the system reserves per block */
} sim_sm_limits;
sim_sm_limits sim_sm_limits_of(int cc_major, int cc_minor);

#endif

/*
 * cuInit and the process-wide state of the simulated driver (init.c): the process globals G,
 * the CUDA ordinal -> physical device map, handle validity, the node slot.
 */
#ifndef VGPU_SIM_CUDA_INIT_H
#define VGPU_SIM_CUDA_INIT_H

#include "objects.h"

#include "../common/config.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

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

#define SIM_ALLOC_ALIGN     512ull         /* cuMemAlloc & co charge sizes rounded up to this */
#define SIM_VMM_GRANULARITY (G.alloc_gran) /* cuMemCreate / cuMemAddressReserve granularity (the page size) */

CUresult sim_check_init(void);           /* CUDA_ERROR_NOT_INITIALIZED before cuInit */
CUresult sim_check_device(CUdevice dev); /* also checks init */
int sim_ensure_slot(void);               /* claim the node slot (under G.lock); -1 on failure */
/* A forked child starts with no CUDA state: the process globals reset (fork.c). */
void sim_init_after_fork_child(void);

#endif

/*
 * Graph allocations and each device's graph memory pool (gmempool.c): an allocation's address
 * from its node's creation, its pages from the pool while a launch holds it.
 */
#ifndef VGPU_SIM_CUDA_GMEMPOOL_H
#define VGPU_SIM_CUDA_GMEMPOOL_H

#include "objects.h"

#include <stddef.h>
#include <stdint.h>

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

/* A new graph allocation of `bytes` on `dev`: its address only, nothing charged, no reference. */
CUresult sim_gmem_new(int dev, size_t bytes, struct sim_gmem **out);
void sim_gmem_drop_unreferenced(struct sim_gmem *gm); /* a node was never made for it */
void sim_gmem_ref(struct sim_gmem *gm);               /* one more graph / exec node refers to it */
void sim_gmem_unref(struct sim_gmem *gm);             /* the graph or exec holding the node died */
/* The graph allocation at p for a new free node (one per allocation), with a reference held
 * across the node's creation; NULL if p is none or already has one. */
struct sim_gmem *sim_gmem_claim_free(CUdeviceptr p);
void sim_gmem_unclaim_free(struct sim_gmem *gm); /* the free node was not made */
/* Before a launch executes the exec's nodes: free what AUTO_FREE_ON_LAUNCH frees, refuse a
 * relaunch over unfreed allocations, reserve the launch's peak in the device's graph pool. */
CUresult sim_gmem_launch_prepare(const struct CUgraphExec_st *e);
void sim_gmem_alloc_exec(struct sim_gmem *gm, struct CUctx_st *ctx); /* an alloc node runs */
void sim_gmem_free_exec(struct sim_gmem *gm);                        /* a free node runs */

#endif

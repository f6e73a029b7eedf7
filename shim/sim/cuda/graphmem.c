/*
 * Graph memory nodes: cuGraphAddMemAllocNode / cuGraphAddMemFreeNode, and cuMemAllocAsync /
 * cuMemFreeAsync captured from a stream. An alloc node's allocation gets its address when the
 * node is made; its memory comes from the device's graph memory pool when the graph is launched
 * (gmempool.c, which describes the model).
 */
#include "graphmem.h"

#include "gmempool.h"
#include "graph.h"
#include "init.h"

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
    if ((rc = sim_gmem_new(pp->location.id, nodeParams->bytesize, &gm)) != CUDA_SUCCESS) return rc;
    struct CUgraphNode_st tmpl = {.type = NODE_MEM_ALLOC, .bytes = nodeParams->bytesize, .dst = gm->base, .gm = gm};
    if (!(*phGraphNode = sim_graph_append(hGraph, &tmpl))) {
        sim_gmem_drop_unreferenced(gm);
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
    struct sim_gmem *gm = sim_gmem_claim_free(dptr);
    if (!gm) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphNode_st tmpl = {.type = NODE_MEM_FREE, .dst = dptr, .gm = gm};
    rc = (*phGraphNode = sim_graph_append(hGraph, &tmpl)) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    if (rc != CUDA_SUCCESS) sim_gmem_unclaim_free(gm);
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
    if ((*rc = sim_gmem_new(dev, bytes, &gm)) != CUDA_SUCCESS) return 1;
    struct CUgraphNode_st tmpl = {.type = NODE_MEM_ALLOC, .bytes = bytes, .dst = gm->base, .gm = gm};
    CUdeviceptr base = (CUdeviceptr)gm->base;
    int captured = sim_capture_add(s, &tmpl);
    sim_gmem_drop_unreferenced(gm); /* not recorded (capture ended or invalidated): nothing refers to it */
    if (!captured) return 0;        /* the capture ended meanwhile: an ordinary allocation */
    *out = base;
    return 1;
}

int sim_gmem_capture_free(struct CUstream_st *s, CUdeviceptr p, CUresult *rc) {
    pthread_mutex_lock(&s->mu);
    int capturing = s->capturing;
    pthread_mutex_unlock(&s->mu);
    if (!capturing) return 0;
    struct sim_gmem *gm = sim_gmem_claim_free(p);
    *rc = CUDA_SUCCESS;
    if (!gm) {
        /* a free node frees only graph allocations: the capture cannot record this one */
        pthread_mutex_lock(&s->mu);
        s->capture_invalid = 1;
        pthread_mutex_unlock(&s->mu);
        *rc = CUDA_ERROR_INVALID_VALUE;
        return 1;
    }
    struct CUgraphNode_st tmpl = {.type = NODE_MEM_FREE, .dst = p, .gm = gm};
    if (!sim_capture_add(s, &tmpl)) {
        sim_gmem_unclaim_free(gm);
        sim_gmem_unref(gm);
        return 0;
    }
    sim_gmem_unref(gm);
    return 1;
}

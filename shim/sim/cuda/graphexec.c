/*
 * Instantiated graphs: an exec is a private copy of its graph's nodes (graph.c); launching it runs
 * them in capture order on the launch stream: kernels occupy the device timeline as launches do,
 * copies and memsets move data at launch, memory nodes take and return graph memory
 * (gmempool.c), reserved when the exec is launched.
 */
#include "copy.h"
#include "duration.h"
#include "gmempool.h"
#include "graph.h"
#include "init.h"
#include "memory.h"
#include "stream.h"
#include "userobj.h"

#include <stdlib.h>

static CUresult instantiate(CUgraphExec *pexec, CUgraph g, unsigned long long flags) {
    if (!pexec) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_VALID(g, MAGIC_GRAPH) || (flags & ~0xfull)) return CUDA_ERROR_INVALID_VALUE;
    if (g->has_mem && g->nexec > 0) return CUDA_ERROR_INVALID_VALUE; /* memory nodes: one instantiation at a time */
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    struct CUgraphNode_st *arr = g->n ? calloc(g->n, sizeof *arr) : NULL;
    if (!e || (g->n && !arr)) {
        free(e);
        free(arr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t i = 0;
    for (struct CUgraphNode_st *n = g->head; n && arr && i < g->n; n = n->next) {
        arr[i++] = *n;
        if (n->gm) sim_gmem_ref(n->gm);
    }
    g->nexec++;
    sim_urefs_copy(g, &e->urefs);
    e->graph = g;
    e->flags = flags;
    e->n = i;
    e->nodes = arr;
    e->gen = sim_gen();
    e->magic = MAGIC_EXEC;
    *pexec = e;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags) {
    return instantiate(phGraphExec, hGraph, flags);
}

static CUresult instantiate_params(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = instantiate(e, g, p->flags); /* an upload stream has nothing to upload ahead here */
    p->hErrNode_out = NULL;
    p->result_out = rc == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
    return rc;
}

SIM_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    return instantiate_params(phGraphExec, hGraph, instantiateParams);
}

SIM_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                      CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    return instantiate_params(phGraphExec, hGraph, instantiateParams);
}

SIM_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                       char *logBuffer, size_t bufferSize) {
    if (logBuffer && bufferSize) logBuffer[0] = '\0';
    if (phErrorNode) *phErrorNode = NULL;
    return instantiate(phGraphExec, hGraph, 0);
}

SIM_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                          char *logBuffer, size_t bufferSize) {
    return cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

SIM_EXPORT CUresult cuGraphExecGetFlags(CUgraphExec hGraphExec, cuuint64_t *flags) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!flags || !SIM_VALID(hGraphExec, MAGIC_EXEC)) return CUDA_ERROR_INVALID_VALUE;
    *flags = hGraphExec->flags & ~(cuuint64_t)CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD; /* never reported, as in CUDA */
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_VALID(hGraphExec, MAGIC_EXEC)) return CUDA_ERROR_INVALID_VALUE;
    hGraphExec->magic = MAGIC_DEAD; /* kept, like graphs */
    for (size_t i = 0; i < hGraphExec->n; i++)
        if (hGraphExec->nodes[i].gm) sim_gmem_unref(hGraphExec->nodes[i].gm);
    hGraphExec->graph->nexec--;
    sim_urefs_release(&hGraphExec->urefs);
    free(hGraphExec->nodes);
    hGraphExec->nodes = NULL;
    hGraphExec->n = 0;
    return CUDA_SUCCESS;
}

static CUresult graph_launch(CUgraphExec e, CUstream h, int ptds) {
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_VALID(e, MAGIC_EXEC)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&s->mu);
    int capturing = s->capturing;
    pthread_mutex_unlock(&s->mu);
    if (!capturing && (rc = sim_gmem_launch_prepare(e)) != CUDA_SUCCESS)
        return rc; /* graph memory the device cannot provide: nothing runs */
    for (size_t i = 0; i < e->n; i++) {
        const struct CUgraphNode_st *n = &e->nodes[i];
        if (sim_capture_add(s, n)) continue; /* launching a graph into a capture copies its nodes */
        switch (n->type) {
        case NODE_KERNEL:
            sim_stream_enqueue(s, sim_kernel_sample_ns(n->dur_ns)); /* each run draws its duration */
            break;
        case NODE_MEMCPY: /* the memory may have been freed since capture: check again */
            if ((n->elem && sim_check_device_range(n->dst, n->bytes) != CUDA_SUCCESS) ||
                (n->src && sim_check_device_range(n->src, n->bytes) != CUDA_SUCCESS))
                return CUDA_ERROR_INVALID_VALUE;
            sim_copy_exec(n->dst, n->src_host, n->src, NULL, n->bytes);
            break;
        case NODE_MEMSET:
            if (sim_check_device_range(n->dst, n->bytes * (size_t)n->elem) != CUDA_SUCCESS)
                return CUDA_ERROR_INVALID_VALUE;
            sim_memset_exec(n->dst, n->value, n->bytes, n->elem);
            break;
        case NODE_MEM_ALLOC: sim_gmem_alloc_exec(n->gm, s->ctx); break;
        case NODE_MEM_FREE: sim_gmem_free_exec(n->gm); break;
        }
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphLaunch(CUgraphExec hGraph, CUstream hStream) { return graph_launch(hGraph, hStream, 0); }
SIM_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_launch(hGraphExec, hStream, 1);
}

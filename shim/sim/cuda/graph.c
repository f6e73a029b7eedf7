/*
 * Stream capture and graphs. A graph here is the ordered list of the work captured from a stream
 * (kernels with their modelled duration, memcpy and memset nodes); graphexec.c instantiates and
 * launches it. Captured event records / waits are not recorded as nodes. Memory alloc / free
 * nodes, added or captured from cuMemAllocAsync / cuMemFreeAsync, are graphmem.c's.
 * A synchronous call on a capturing stream invalidates the capture
 * (cuStreamEndCapture then returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED), as in CUDA.
 */
#include "graph.h"

#include "gmempool.h"
#include "init.h"
#include "stream.h"
#include "userobj.h"

#include <stdlib.h>
#include <string.h>

static struct CUgraph_st *graph_new(void) {
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (g) {
        g->gen = sim_gen();
        g->magic = MAGIC_GRAPH;
    }
    return g;
}

static void graph_free(struct CUgraph_st *g) {
    for (struct CUgraphNode_st *n = g->head, *next; n; n = next) {
        next = n->next;
        if (n->gm) sim_gmem_unref(n->gm);
        free(n);
    }
    g->head = g->tail = NULL;
    g->n = 0;
    sim_urefs_release(&g->urefs);
    g->magic = MAGIC_DEAD; /* the struct is kept: a stale handle fails validation, no use-after-free */
}

struct CUgraphNode_st *sim_graph_append(struct CUgraph_st *g, const struct CUgraphNode_st *tmpl) {
    struct CUgraphNode_st *n = malloc(sizeof *n);
    if (!n) return NULL;
    *n = *tmpl;
    n->magic = MAGIC_NODE;
    n->next = NULL;
    if (n->gm) { /* a memory node (graphmem.c, gmempool.c) */
        sim_gmem_ref(n->gm);
        g->has_mem = 1;
    }
    if (g->tail)
        g->tail->next = n;
    else
        g->head = n;
    g->tail = n;
    g->n++;
    return n;
}

int sim_capture_add(struct CUstream_st *s, const struct CUgraphNode_st *tmpl) {
    pthread_mutex_lock(&s->mu);
    if (!s->capturing) {
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    if (!s->capture_invalid && !sim_graph_append(s->capture_graph, tmpl)) s->capture_invalid = 1;
    pthread_mutex_unlock(&s->mu);
    return 1;
}

static CUresult begin_capture(CUstream h, CUstreamCaptureMode mode, int ptds) {
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if ((int)mode < 0 || (int)mode > 2) return CUDA_ERROR_INVALID_VALUE;
    if (s->kind == STREAM_LEGACY)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream cannot be captured */
    struct CUgraph_st *g = graph_new();
    if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&s->mu);
    if (s->capturing) {
        pthread_mutex_unlock(&s->mu);
        graph_free(g);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    s->capturing = 1;
    s->capture_invalid = 0;
    s->capture_mode = mode;
    s->capture_graph = g;
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
    return begin_capture(hStream, mode, 0);
}
SIM_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode) {
    return begin_capture(hStream, mode, 1);
}
SIM_EXPORT CUresult cuStreamBeginCapture(CUstream hStream) {
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, 0);
}
SIM_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream hStream) {
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, 1);
}

static CUresult end_capture(CUstream h, CUgraph *phGraph, int ptds) {
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&s->mu);
    if (!s->capturing) {
        pthread_mutex_unlock(&s->mu);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    struct CUgraph_st *g = s->capture_graph;
    int invalid = s->capture_invalid;
    s->capturing = 0;
    s->capture_invalid = 0;
    s->capture_graph = NULL;
    pthread_mutex_unlock(&s->mu);
    if (invalid) {
        graph_free(g);
        *phGraph = NULL;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *phGraph = g;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) { return end_capture(hStream, phGraph, 0); }
SIM_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph) {
    return end_capture(hStream, phGraph, 1);
}

static CUresult capture_info(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                             const CUgraphNode **deps, size_t *ndeps, int ptds) {
    if (!st) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&s->mu);
    *st = !s->capturing ? CU_STREAM_CAPTURE_STATUS_NONE
                        : (s->capture_invalid ? CU_STREAM_CAPTURE_STATUS_INVALIDATED : CU_STREAM_CAPTURE_STATUS_ACTIVE);
    if (id) /* unique per capture: the graph being built */
        *id = (cuuint64_t)(uintptr_t)s->capture_graph;
    if (g) *g = s->capturing ? s->capture_graph : NULL;
    if (deps) /* nodes are kept in capture order: the last one is what the next depends on */
        *deps = s->capturing && s->capture_graph->tail ? (const CUgraphNode *)&s->capture_graph->tail : NULL;
    if (ndeps) *ndeps = s->capturing && s->capture_graph->tail ? 1 : 0;
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}

static CUresult is_capturing(CUstream h, CUstreamCaptureStatus *st, int ptds) {
    return capture_info(h, st, NULL, NULL, NULL, NULL, ptds);
}

SIM_EXPORT CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    return is_capturing(hStream, captureStatus, 0);
}
SIM_EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    return is_capturing(hStream, captureStatus, 1);
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                              cuuint64_t *id_out, CUgraph *graph_out,
                                              const CUgraphNode **dependencies_out, size_t *numDependencies_out) {
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out, numDependencies_out, 0);
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                   cuuint64_t *id_out, CUgraph *graph_out,
                                                   const CUgraphNode **dependencies_out, size_t *numDependencies_out) {
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out, numDependencies_out, 1);
}

/* 12.3: edge data as well; every captured edge is a default one (NULL says so) */
SIM_EXPORT CUresult cuStreamGetCaptureInfo_v3(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                              cuuint64_t *id_out, CUgraph *graph_out,
                                              const CUgraphNode **dependencies_out,
                                              const CUgraphEdgeData **edgeData_out, size_t *numDependencies_out) {
    if (edgeData_out) *edgeData_out = NULL;
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out, numDependencies_out, 0);
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                   cuuint64_t *id_out, CUgraph *graph_out,
                                                   const CUgraphNode **dependencies_out,
                                                   const CUgraphEdgeData **edgeData_out, size_t *numDependencies_out) {
    if (edgeData_out) *edgeData_out = NULL;
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out, numDependencies_out, 1);
}

SIM_EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    if (!phGraph || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    struct CUgraph_st *g = graph_new();
    if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
    *phGraph = g;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphDestroy(CUgraph hGraph) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_VALID(hGraph, MAGIC_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    graph_free(hGraph);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes) {
    if (!numNodes) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_VALID(hGraph, MAGIC_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    if (!nodes) {
        *numNodes = hGraph->n;
        return CUDA_SUCCESS;
    }
    size_t i = 0;
    for (struct CUgraphNode_st *n = hGraph->head; n && i < *numNodes; n = n->next) nodes[i++] = n;
    for (size_t j = i; j < *numNodes; j++) nodes[j] = NULL;
    *numNodes = i;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphNodeGetType(CUgraphNode hNode, CUgraphNodeType *type) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!hNode || hNode->magic != MAGIC_NODE || !type) return CUDA_ERROR_INVALID_VALUE;
    static const CUgraphNodeType types[] = {[NODE_KERNEL] = CU_GRAPH_NODE_TYPE_KERNEL,
                                            [NODE_MEMCPY] = CU_GRAPH_NODE_TYPE_MEMCPY,
                                            [NODE_MEMSET] = CU_GRAPH_NODE_TYPE_MEMSET,
                                            [NODE_MEM_ALLOC] = CU_GRAPH_NODE_TYPE_MEM_ALLOC,
                                            [NODE_MEM_FREE] = CU_GRAPH_NODE_TYPE_MEM_FREE};
    *type = types[hNode->type];
    return CUDA_SUCCESS;
}

/* The calling thread's capture interaction mode (cudaThreadExchangeStreamCaptureMode): kept and
 * exchanged; the simulator does not refuse unsafe calls during another thread's capture. */
static __thread CUstreamCaptureMode thread_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

SIM_EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    if (!mode || (unsigned)*mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = thread_capture_mode;
    thread_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

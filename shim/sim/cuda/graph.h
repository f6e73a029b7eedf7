/*
 * Graphs and stream capture: building a graph (graph.c).
 */
#ifndef VGPU_SIM_CUDA_GRAPH_H
#define VGPU_SIM_CUDA_GRAPH_H

#include "objects.h"

int sim_capture_add(struct CUstream_st *s, const struct CUgraphNode_st *tmpl); /* 1 if captured */
/* Append a copy of tmpl to g (a memory node takes a reference on its allocation); NULL: no memory. */
struct CUgraphNode_st *sim_graph_append(struct CUgraph_st *g, const struct CUgraphNode_st *tmpl);

#endif

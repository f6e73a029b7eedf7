/*
 * Kernel-node parameters of graphs. A kernel node here keeps only its modelled duration (graph.c),
 * not the function, grid and arguments it was captured with, so it cannot hand them back or take
 * new ones: the two entry points answer CUDA_ERROR_NOT_SUPPORTED for a kernel node (a fidelity
 * limit, docs/simulator.md) and CUDA_ERROR_INVALID_VALUE for any other node, as the driver does.
 * cuBLASLt resolves them at its driver initialisation and refuses a driver without them.
 */
#include "init.h"

static CUresult kernel_node(CUgraphNode hNode, const void *params) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!params) return CUDA_ERROR_INVALID_VALUE;
    if (!hNode || hNode->magic != MAGIC_NODE) return CUDA_ERROR_INVALID_HANDLE;
    return hNode->type == NODE_KERNEL ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuGraphKernelNodeGetParams(CUgraphNode hNode, CUDA_KERNEL_NODE_PARAMS *nodeParams) {
    return kernel_node(hNode, nodeParams);
}
SIM_EXPORT CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode hNode, CUDA_KERNEL_NODE_PARAMS *nodeParams) {
    return kernel_node(hNode, nodeParams);
}

SIM_EXPORT CUresult cuGraphExecKernelNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                   const CUDA_KERNEL_NODE_PARAMS *nodeParams) {
    if (!SIM_VALID(hGraphExec, MAGIC_EXEC)) return CUDA_ERROR_INVALID_HANDLE;
    return kernel_node(hNode, nodeParams);
}

SIM_EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                      const CUDA_KERNEL_NODE_PARAMS *nodeParams) {
    return cuGraphExecKernelNodeSetParams(hGraphExec, hNode, nodeParams);
}

/*
 * Graph memory nodes (graphmem.c): added to graphs, or captured from cuMemAllocAsync / cuMemFreeAsync.
 */
#ifndef VGPU_SIM_CUDA_GRAPHMEM_H
#define VGPU_SIM_CUDA_GRAPHMEM_H

#include "objects.h"

/* cuMemAllocAsync / cuMemFreeAsync on a capturing stream become alloc / free nodes: 1 if so
 * (*rc then holds the result), 0 if the stream is not capturing. */
int sim_gmem_capture_alloc(struct CUstream_st *s, int dev, size_t bytes, CUdeviceptr *out, CUresult *rc);
int sim_gmem_capture_free(struct CUstream_st *s, CUdeviceptr p, CUresult *rc);

#endif

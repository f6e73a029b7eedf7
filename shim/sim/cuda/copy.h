/*
 * memcpy / memset (copy.c): what a copy or memset node does when it runs.
 */
#ifndef VGPU_SIM_CUDA_COPY_H
#define VGPU_SIM_CUDA_COPY_H

#include "objects.h"

CUresult sim_copy_exec(CUdeviceptr dst, const void *src_host, CUdeviceptr src, void *dst_host, size_t n);
CUresult sim_memset_exec(CUdeviceptr dst, unsigned value, size_t n, int elem);

#endif

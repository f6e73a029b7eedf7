/*
 * Kernels named sim_arg<K>ns run, per wave, the ns in their parameter K (argdur.c).
 */
#ifndef VGPU_SIM_CUDA_ARGDUR_H
#define VGPU_SIM_CUDA_ARGDUR_H

#include "objects.h"

#include <stdint.h>

int sim_dur_arg_of_name(const char *name); /* 1 + K, or 0 for any other name */
uint64_t sim_arg_kernel_ns(const struct CUfunc_st *f, void **params, uint64_t blocks, int dev);

#endif

/*
 * Kernel durations (duration.c): the modelled time of a launch and each run's draw around it.
 */
#ifndef VGPU_SIM_CUDA_DURATION_H
#define VGPU_SIM_CUDA_DURATION_H

#include "objects.h"

#include <stdint.h>

uint64_t sim_kernel_ns(const struct CUfunc_st *f, uint64_t blocks, int dev); /* the modelled mean */
/* a kernel's duration drawn around its modelled mean (SIMGPU_KERNEL_SPREAD_PCT, ...) */
uint64_t sim_kernel_sample_ns(uint64_t mean_ns);

#endif

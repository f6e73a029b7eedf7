/*
 * Modules, libraries, kernels, functions (module.c).
 */
#ifndef VGPU_SIM_CUDA_MODULE_H
#define VGPU_SIM_CUDA_MODULE_H

#include "objects.h"

struct CUfunc_st *sim_func_resolve(CUfunction f); /* a function or a kernel; NULL if invalid */

#endif

/*
 * A module's global variables, allocated (charged) in its context (modglobals.c).
 */
#ifndef VGPU_SIM_CUDA_MODGLOBALS_H
#define VGPU_SIM_CUDA_MODGLOBALS_H

#include "objects.h"

/* Scan a PTX image (text) for .global variables; each is allocated (charged) in the module's
 * context. Returns CUDA_SUCCESS for images without any (cubins, fatbins). */
CUresult sim_module_globals(struct CUmod_st *m, const void *image);
CUresult sim_module_globals_fatbin(struct CUmod_st *m, const void *image, int sm);

#endif

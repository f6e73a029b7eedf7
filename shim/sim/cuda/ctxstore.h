/*
 * Context-local storage of the runtime's private table (ctxstore.c).
 */
#ifndef VGPU_SIM_CUDA_CTXSTORE_H
#define VGPU_SIM_CUDA_CTXSTORE_H

#include "objects.h"

const void *sim_ctxstore_table(void);
void sim_ctxstore_end(struct CUctx_st *c); /* run the destructors: the context ends (no lock held) */

#endif

/*
 * The calling thread's stack of current contexts (ctxstack.c).
 */
#ifndef VGPU_SIM_CUDA_CTXSTACK_H
#define VGPU_SIM_CUDA_CTXSTACK_H

#include "objects.h"

struct CUctx_st *sim_current_ctx(void);
CUresult sim_get_ctx(struct CUctx_st **out);  /* current context or CUDA_ERROR_INVALID_CONTEXT */
int sim_ctx_usable(const struct CUctx_st *c); /* valid, and (a primary context) retained */
int sim_ctx_stack_full(void);                 /* the calling thread's stack has no room for one more */
void sim_ctx_push(struct CUctx_st *c);        /* onto the calling thread's stack (not full) */
void sim_ctx_drop(struct CUctx_st *c);        /* from the calling thread's stack: it was destroyed */
void sim_ctxstack_after_fork(void);           /* the forking thread is the child's only thread */

#endif

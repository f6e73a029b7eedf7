/*
 * Primary and explicit contexts: creation, destruction, synchronisation (context.c).
 */
#ifndef VGPU_SIM_CUDA_CONTEXT_H
#define VGPU_SIM_CUDA_CONTEXT_H

#include "objects.h"

void sim_contexts_after_fork(void); /* a forked child: no primary context flags */

#endif

/*
 * User object references held by graphs and execs (userobj.c).
 */
#ifndef VGPU_SIM_CUDA_USEROBJ_H
#define VGPU_SIM_CUDA_USEROBJ_H

#include "objects.h"

struct sim_uref;
void sim_urefs_copy(const struct CUgraph_st *g, struct sim_uref **to);
void sim_urefs_release(struct sim_uref **list);

#endif

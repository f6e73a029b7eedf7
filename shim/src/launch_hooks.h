/* The launch paths (launch_hooks.c) other hook files end in. */
#ifndef VGPU_LAUNCH_HOOKS_H
#define VGPU_LAUNCH_HOOKS_H

#include "vgpu/cuda_api.h"

/* The compute cap's graph launch paths, called by graphmem.c's hooks. */
CUresult vgpu_launch_graph(CUgraphExec g, CUstream s);
CUresult vgpu_launch_graph_ptsz(CUgraphExec g, CUstream s);

#endif

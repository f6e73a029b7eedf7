/* Graph memory (graphmem.c): graph allocation nodes, charged at launch. */
#ifndef VGPU_GRAPHMEM_H
#define VGPU_GRAPHMEM_H

#include "vgpu/cuda_api.h"

/* Is the stream capturing (cuStreamIsCapturing, or its _ptsz form)? Captured stream-ordered
 * allocations take no memory until the graph is launched. */
int vgpu_graphmem_capturing(CUstream s, int ptsz);

#endif

/* A new accounting file's contents (region_init.c): shared by the shim and the Python binding. */
#ifndef VGPU_REGION_INIT_H
#define VGPU_REGION_INIT_H

#include "vgpu/region.h"

/* Fill a zeroed, mapped region (its lock word stays 0: free): the header, the magic last; 0 or -1. */
int vgpu_region_init(struct vgpu_region *r);

#endif

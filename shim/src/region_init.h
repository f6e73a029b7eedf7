/* A new accounting file's contents (region_init.c): shared by the shim and the Python binding. */
#ifndef VGPU_REGION_INIT_H
#define VGPU_REGION_INIT_H

#include <pthread.h>

#include "vgpu/region.h"

/* A robust, process-shared mutex in *m; 0 or -1. */
int vgpu_region_init_mutex(pthread_mutex_t *m);
/* Fill a zeroed, mapped region: its lock and header, the magic last; 0 or -1. */
int vgpu_region_init(struct vgpu_region *r);

#endif

/* The burst pool file's entries read and written under their sequence numbers (pool_io.c): the one
 * implementation, compiled into libvgpu.so (the reader) and into the Python binding
 * sharing._region_cffi (the plugin's writer, sharing/burstpool.py). Layout: vgpu/region.h. */
#ifndef VGPU_POOL_IO_H
#define VGPU_POOL_IO_H

#include <stddef.h>
#include <stdint.h>

#include "vgpu/region.h"

/* Fill a zeroed, mapped pool file: the header, the magic last. 0. */
int vgpu_pool_init(struct vgpu_pool *p);
/* 0 when the header is a pool file of this layout whose size is `size`, else -1 and why. */
int vgpu_pool_check(const struct vgpu_pool *p, uint64_t size, char *why, size_t len);
/* Rewrite a grant entry (one writer at a time: the plugin, under its lock). */
void vgpu_pool_grant_write(struct vgpu_pool_grant *g, uint64_t key, uint32_t device, uint32_t state, uint64_t request,
                           uint64_t limit, uint64_t grant, uint64_t deadline_unix_ns);
/* Rewrite a device entry (one writer at a time). */
void vgpu_pool_device_write(struct vgpu_pool_device *d, uint64_t capacity, uint64_t reserved, uint64_t requested,
                            uint64_t pool, uint64_t granted);
/* A consistent copy of a grant entry: 0, or -1 when a writer held it through every try (the
 * caller counts that as no grant). */
int vgpu_pool_grant_read(const struct vgpu_pool_grant *g, struct vgpu_pool_grant *out);

#endif

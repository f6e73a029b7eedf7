/* The process's own record of what it charged (track.c), keyed by pointer or handle. */
#ifndef VGPU_TRACK_H
#define VGPU_TRACK_H

#include <stdint.h>

enum vgpu_track_kind {
    VGPU_TRACK_PTR = 1,    /* cuMemAlloc*, cuMemAllocManaged, cuMemAllocPitch, async allocations */
    VGPU_TRACK_HANDLE = 2, /* cuMemCreate handles: aux = the driver's references and the mappings (vmm.c) */
    VGPU_TRACK_ARRAY = 3,
    VGPU_TRACK_MIPMAP = 4,
    VGPU_TRACK_CTX = 5,   /* contexts' reserve */
    VGPU_TRACK_ASYNC = 6, /* stream-ordered allocations: key ptr, aux = its pool's record (pools.c) */
};
int vgpu_track_add(int kind, uint64_t key, int dev, uint64_t bytes);    /* 0, or -1 out of memory */
int vgpu_track_take(int kind, uint64_t key, int *dev, uint64_t *bytes); /* 1 found+removed, 0 not */
/* The same with one more word per record (pools.c: the allocation's pool). */
int vgpu_track_add_aux(int kind, uint64_t key, int dev, uint64_t bytes, uint64_t aux);
int vgpu_track_take_aux(int kind, uint64_t key, int *dev, uint64_t *bytes, uint64_t *aux);
/* A record's fields left in place (1 found, 0 not); its aux word changed in place (vmm.c's counts). */
int vgpu_track_peek_aux(int kind, uint64_t key, int *dev, uint64_t *bytes, uint64_t *aux);
int vgpu_track_set_aux(int kind, uint64_t key, uint64_t aux);
/* A record's bytes moved from `from` to `to` if it exists and holds `from`: 1 moved, 0 not
 * (context.c: a context's charge settled on the driver's figure while it may be destroyed). */
int vgpu_track_move_bytes(int kind, uint64_t key, uint64_t from, uint64_t to);

/* cuMemMap's mappings of charged handles (vmm.c): [va, va + size) maps `handle`. A handle's memory
 * lives while it is mapped, so its charge does too; an unmap gives a range, which may hold several
 * mappings, hence an ordered table rather than the hash above. */
int vgpu_track_map_add(uint64_t va, uint64_t size, uint64_t handle); /* 0, or -1 out of memory */
/* Removes one recorded mapping inside [va, va + size) (`whole`: wholly inside; else any that meets
 * it) and gives its handle: 1, or 0 when there is none. */
int vgpu_track_map_take(uint64_t va, uint64_t size, int whole, uint64_t *handle);

void vgpu_track_reset(void); /* fork child: the parent's allocations are not ours */

#endif

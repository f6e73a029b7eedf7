/*
 * Elastic demand records of the compute cap (demand.c): this slice's own, written through a
 * mapping, and the other slices' on the node, read as copies.
 */
#ifndef VGPU_DEMAND_H
#define VGPU_DEMAND_H

#include <stdint.h>

#include "vgpu/compute_state.h"

/* Where the records are: the node-state directory ("" = none: elastic slices keep their cap),
 * the own file (VGPU_DEMAND_FILE, or "" to create <dir>/<slice id>.demand, and the directory
 * if needed; stale files of this user's ended slices are removed), and whether the directory is
 * the default one (then it must be a real directory of this user, never a link). */
int vgpu_demand_configure(const char *dir, const char *own_path, int default_dir);
const char *vgpu_demand_dir(void);
/* This slice's record for device index dev (physical device `uuid`), with its settings written;
 * NULL when no record can be had (logged once per cause). */
struct vgpu_node_slot *vgpu_demand_own(int dev, const uint8_t uuid[16], uint64_t slice_id, uint32_t cap_permille,
                                       uint32_t policy, int32_t priority);
/* The other slices' believable records for the device `uuid` (at most max, into out): their
 * number, or -1 when none can be read now (no directory, or another thread is reading). */
int vgpu_demand_peers(const uint8_t uuid[16], int64_t now, struct vgpu_node_slot *out, int max);
void vgpu_demand_atfork_child(void);

#endif

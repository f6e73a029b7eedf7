/*
 * Per-device compute (SM cap) state of a slice, embedded in the accounting file (region.h).
 * Owned by the compute-cap code (shim/src/compute*.c). Plain C between the CFFI markers so the
 * Python reader can see it; any change bumps VGPU_REGION_LAYOUT_VERSION in region.h.
 */
#ifndef VGPU_COMPUTE_STATE_H
#define VGPU_COMPUTE_STATE_H

#include <stdint.h>

/* CFFI-BEGIN */
struct vgpu_compute_state {
    uint64_t reserved[64]; /* placeholder until the compute cap lands */
};
/* CFFI-END */

#endif

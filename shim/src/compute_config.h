/* The compute cap's settings, read by compute_config.c, used by compute.c. */
#ifndef VGPU_COMPUTE_CONFIG_H
#define VGPU_COMPUTE_CONFIG_H

#include <stdint.h>

#include "vgpu/region.h"

struct vgpu_compute_config {
    uint32_t cap[VGPU_MAX_DEVICES]; /* permille, 0 = none */
    uint32_t policy;                /* VGPU_COMPUTE_POLICY_* */
    int32_t priority;               /* -100..100, lower is served first */
    int nvml_loop;                  /* VGPU_COMPUTE_NVML */
    int enabled;                    /* some device has a cap and the policy is not off */
};

/* Read every setting into *c (and configure the demand records); 0, or -1 after reporting the
 * bad value with vgpu_config_error(). */
int vgpu_compute_config_load(struct vgpu_compute_config *c);

#endif

/* The environment contract (config.c): parsed once by vgpu_init, read by everyone after. */
#ifndef VGPU_CONFIG_H
#define VGPU_CONFIG_H

#include <stdint.h>

#include "enforced.h" /* struct vgpu_enforced, VGPU_MAX_DEVICES, vgpu_parse_bytes */

struct vgpu_config {
    int disabled;                            /* CUDA_DISABLE_CONTROL=true: pure passthrough */
    int log_level;                           /* LIBCUDA_LOG_LEVEL, default VGPU_LOG_WARN */
    int any_limit;                           /* some device has a memory limit */
    uint64_t limit[VGPU_MAX_DEVICES];        /* bytes per app-visible device index; 0 = none */
    uint64_t context_reserve;                /* VGPU_CONTEXT_RESERVE: the least charged per context */
    uint64_t context_size[VGPU_MAX_DEVICES]; /* VGPU_CONTEXT_SIZE(_<i>): expected context size, 0 none */
    char *region_path;                       /* CUDA_DEVICE_MEMORY_SHARED_CACHE (copied), NULL = private */
    struct vgpu_enforced enforced;           /* quotas, caps, policy, priority (enforced.c) */
    /* Bursting (docs/policy.md): a limit above the request, borrowed from the plugin's pool file. */
    int any_burst;                          /* some device has a limit above its request */
    uint64_t burst_limit[VGPU_MAX_DEVICES]; /* VGPU_MEMORY_BURST_LIMIT_<i>: bytes, 0 = none */
    uint64_t burst_entry[VGPU_MAX_DEVICES]; /* VGPU_BURST_GRANT_<i>: the device's grant entry */
    uint64_t burst_key[VGPU_MAX_DEVICES];   /* VGPU_BURST_KEY_<i>: that entry's key */
    char *burst_pool;                       /* VGPU_BURST_POOL (copied): the pool file, NULL = none */
    int show_limit;                         /* VGPU_MEMORY_SHOW_LIMIT: the slice sees its limit */
};
/* Parse the environment into the configuration vgpu_config() returns. 0, or -1 after printing
 * the one config-error line. Called once (vgpu_init). */
int vgpu_config_load(void);
/* The loaded configuration (valid after vgpu_init() returned CUDA_SUCCESS). */
const struct vgpu_config *vgpu_config(void);

#endif

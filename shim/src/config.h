/* The environment contract (config.c): parsed once by vgpu_init, read by everyone after. */
#ifndef VGPU_CONFIG_H
#define VGPU_CONFIG_H

#include <stdint.h>

#include "vgpu/region.h" /* VGPU_MAX_DEVICES */

struct vgpu_config {
    int disabled;                            /* CUDA_DISABLE_CONTROL=true: pure passthrough */
    int log_level;                           /* LIBCUDA_LOG_LEVEL, default VGPU_LOG_WARN */
    int any_limit;                           /* some device has a memory limit */
    uint64_t limit[VGPU_MAX_DEVICES];        /* bytes per app-visible device index; 0 = none */
    uint64_t context_reserve;                /* VGPU_CONTEXT_RESERVE: the least charged per context */
    uint64_t context_size[VGPU_MAX_DEVICES]; /* VGPU_CONTEXT_SIZE(_<i>): expected context size, 0 none */
    char *region_path;                       /* CUDA_DEVICE_MEMORY_SHARED_CACHE (copied), NULL = private */
};
/* Parse the environment into the configuration vgpu_config() returns. 0, or -1 after printing
 * the one config-error line. Called once (vgpu_init). */
int vgpu_config_load(void);
/* The loaded configuration (valid after vgpu_init() returned CUDA_SUCCESS). */
const struct vgpu_config *vgpu_config(void);
/* PREFIX (every device) and PREFIX_<i> (device i, 0..VGPU_MAX_DEVICES-1) from the settings: out[i] is device i's
 * parsed value (PREFIX_<i> over PREFIX, 0 when neither is set), have[i] (may be NULL) whether one
 * was set. Another index, or a value `parse` refuses, is a config error: -1 after the line. */
typedef int (*vgpu_setting_parser)(const char *var, const char *value, uint64_t *out);
int vgpu_indexed_settings(const char *prefix, vgpu_setting_parser parse, uint64_t out[VGPU_MAX_DEVICES],
                          int have[VGPU_MAX_DEVICES]);
/* Memory quantity parser: exactly the forms of sharing/quantity.py. 0 ok, -1 malformed or
 * out of range (then *why says which). */
int vgpu_parse_bytes(const char *text, uint64_t *out, const char **why);
extern const char vgpu_quantity_forms[];

#endif

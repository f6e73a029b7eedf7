/*
 * The environment contract (docs/shim.md): parsed once, fail closed.
 * A malformed value is never ignored: the process must not run unlimited because of a typo.
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "config.h"
#include "enforced.h"
#include "log.h"
#include "settings.h"

static int parse_limit(const char *var, const char *v, uint64_t *out) {
    const char *why;
    if (vgpu_parse_bytes(v, out, &why) != 0) {
        vgpu_config_error(var, v, why, vgpu_quantity_forms);
        return -1;
    }
    return 0;
}

static int refused(const struct vgpu_setting_fault *f) {
    vgpu_config_error(f->var, f->value, f->why, f->forms);
    return -1;
}

static struct vgpu_config loaded;

const struct vgpu_config *vgpu_config(void) { return &loaded; }

static int load(struct vgpu_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->log_level = VGPU_LOG_WARN;
    const char *v = getenv("LIBCUDA_LOG_LEVEL"); /* the tenant's to choose, even under a limits file */
    if (v != NULL && *v != '\0') {
        char *end;
        errno = 0;
        long lvl = strtol(v, &end, 10);
        if (errno || end == v || *end != '\0' || lvl < 0 || lvl > 4) {
            vgpu_config_error("LIBCUDA_LOG_LEVEL", v, "not a level", "0 (config errors only) to 4 (debug)");
            return -1;
        }
        cfg->log_level = (int)lvl;
    }
    vgpu_log_set_level(cfg->log_level);
    if (vgpu_settings_load() != 0) return -1;
    /* the quotas, caps, policy and priority: resolved as `vgpu run` resolves them (enforced.c) */
    struct vgpu_setting_fault fault;
    if (vgpu_enforced_resolve(vgpu_setting_entries(), &cfg->enforced, &fault) != 0) return refused(&fault);
    cfg->disabled = cfg->enforced.disabled;
    if (cfg->disabled) return 0; /* pure passthrough: nothing else matters */
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        cfg->limit[i] = cfg->enforced.memory[i];
        if (cfg->limit[i] != 0) cfg->any_limit = 1;
    }

    v = vgpu_setting("VGPU_CONTEXT_RESERVE");
    if (v != NULL && parse_limit("VGPU_CONTEXT_RESERVE", v, &cfg->context_reserve) != 0) return -1;
    /* the size a context takes on each device, handed over by the plugin (ctxmem.c) */
    if (vgpu_indexed_values(vgpu_setting_entries(), "VGPU_CONTEXT_SIZE", vgpu_quantity_value, cfg->context_size, NULL,
                            &fault) != 0)
        return refused(&fault);

    v = vgpu_setting("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    cfg->region_path = (v != NULL && *v != '\0') ? strdup(v) : NULL; /* env may change later */
    return 0;
}

int vgpu_config_load(void) { return load(&loaded); }

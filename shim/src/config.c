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

/* A vgpu_value_parser of whole numbers (grant entries and keys). */
static int count_value(const char *v, uint64_t *out, const char **why, const char **forms) {
    char *end = NULL;
    errno = 0;
    unsigned long long n = v != NULL && *v >= '0' && *v <= '9' ? strtoull(v, &end, 10) : 0;
    *why = "not a whole number";
    *forms = "0|[1-9][0-9]* below 2^64";
    if (end == NULL || errno != 0 || *end != '\0') return -1;
    *out = (uint64_t)n;
    return 0;
}

/* One device's burst settings, checked against its request: 0, or -1 after the one line. */
static int check_burst(const struct vgpu_config *cfg, int d, const int have[3][VGPU_MAX_DEVICES]) {
    char name[64], val[32];
    if (!have[0][d]) {
        if (!have[1][d] && !have[2][d]) return 0;
        snprintf(name, sizeof name, "VGPU_BURST_%s_%d", have[1][d] ? "GRANT" : "KEY", d);
        vgpu_config_error(name, "(set)", "a grant entry for a device without VGPU_MEMORY_BURST_LIMIT",
                          "VGPU_MEMORY_BURST_LIMIT_<i> with VGPU_BURST_GRANT_<i> and VGPU_BURST_KEY_<i>");
        return -1;
    }
    snprintf(name, sizeof name, "VGPU_MEMORY_BURST_LIMIT_%d", d);
    snprintf(val, sizeof val, "%llu", (unsigned long long)cfg->burst_limit[d]);
    const char *why = NULL,
               *allowed = "at least the device's CUDA_DEVICE_MEMORY_LIMIT (its request), which must be set";
    if (cfg->limit[d] == 0)
        why = "a burst limit without a memory limit (request)";
    else if (cfg->burst_limit[d] < cfg->limit[d])
        why = "below the request (CUDA_DEVICE_MEMORY_LIMIT)";
    else if (!have[1][d] || !have[2][d] || cfg->burst_pool == NULL) {
        why = "no pool to borrow from";
        allowed = "VGPU_BURST_POOL, VGPU_BURST_GRANT_<i> and VGPU_BURST_KEY_<i> with it";
    } else if (cfg->burst_entry[d] >= VGPU_POOL_MAX_GRANTS || cfg->burst_key[d] == 0) {
        why = cfg->burst_key[d] == 0 ? "grant key 0 (a free entry's)" : "grant entry past the pool's table";
        allowed = "VGPU_BURST_GRANT_<i> below 1024 and a VGPU_BURST_KEY_<i> other than 0";
    } else {
        for (int e = 0; e < d && why == NULL; e++)
            if (cfg->burst_limit[e] != 0 && cfg->burst_entry[e] == cfg->burst_entry[d])
                why = "two devices share a grant entry";
    }
    if (why != NULL) vgpu_config_error(name, val, why, allowed);
    return why != NULL ? -1 : 0;
}

/* Bursting's settings (docs/policy.md): fail closed on anything malformed or inconsistent. */
static int load_burst(struct vgpu_config *cfg) {
    static int have[3][VGPU_MAX_DEVICES];
    struct vgpu_setting_fault fault;
    char **entries = vgpu_setting_entries();
    if (vgpu_indexed_values(entries, "VGPU_MEMORY_BURST_LIMIT", vgpu_quantity_value, cfg->burst_limit, have[0],
                            &fault) != 0 ||
        vgpu_indexed_values(entries, "VGPU_BURST_GRANT", count_value, cfg->burst_entry, have[1], &fault) != 0 ||
        vgpu_indexed_values(entries, "VGPU_BURST_KEY", count_value, cfg->burst_key, have[2], &fault) != 0)
        return refused(&fault);
    const char *v = vgpu_setting("VGPU_BURST_POOL");
    if (v != NULL && *v == '\0') {
        vgpu_config_error("VGPU_BURST_POOL", v, "empty", "the pool file's absolute path");
        return -1;
    }
    cfg->burst_pool = v != NULL ? strdup(v) : NULL;
    v = vgpu_setting("VGPU_MEMORY_SHOW_LIMIT");
    if (v == NULL || *v == '\0' || !strcasecmp(v, "false") || !strcmp(v, "0"))
        cfg->show_limit = 0;
    else if (!strcasecmp(v, "true") || !strcmp(v, "1"))
        cfg->show_limit = 1;
    else {
        vgpu_config_error("VGPU_MEMORY_SHOW_LIMIT", v, "not a boolean", "true, false, 1, 0");
        return -1;
    }
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        if (check_burst(cfg, d, (const int (*)[VGPU_MAX_DEVICES])have) != 0) return -1;
        if (cfg->burst_limit[d] > cfg->limit[d]) cfg->any_burst = 1;
    }
    return 0;
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
    return load_burst(cfg);
}

int vgpu_config_load(void) { return load(&loaded); }

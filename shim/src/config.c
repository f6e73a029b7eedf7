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
#include "log.h"
#include "settings.h"

const char vgpu_quantity_forms[] = "bytes (e.g. 1073741824), or a number with Ki/Mi/Gi/Ti/Pi (1024), K/M/G/T/P (1000) "
                                   "or k/m/g/t (1024) suffix (e.g. 4Gi, 512m)"; /* == sharing.quantity.ACCEPTED_FORMS */

/* Python's str.strip() whitespace, restricted to ASCII (includes \x1c-\x1f like Python). */
static int py_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f); }

typedef unsigned __int128 u128;

/* Keep in step with sharing/quantity.py (_MULTIPLIERS, _PATTERN); tests/support/quantity_cases.py
 * runs the same table through both. Two-letter suffixes first so "Ki" is not read as "K". */
static const struct {
    const char *suffix;
    uint64_t mult;
} multipliers[] = {
    {"Ki", 1024ULL},
    {"Mi", 1048576ULL},
    {"Gi", 1073741824ULL},
    {"Ti", 1099511627776ULL},
    {"Pi", 1125899906842624ULL},
    {"K", 1000ULL},
    {"M", 1000000ULL},
    {"G", 1000000000ULL},
    {"T", 1000000000000ULL},
    {"P", 1000000000000000ULL},
    /* the field's lower-case suffixes are binary (HAMi-core) */
    {"k", 1024ULL},
    {"m", 1048576ULL},
    {"g", 1073741824ULL},
    {"t", 1099511627776ULL},
};

int vgpu_parse_bytes(const char *text, uint64_t *out, const char **why) {
    *why = "not a memory size";
    if (text == NULL) return -1;
    const char *s = text, *e = text + strlen(text);
    while (s < e && py_space((unsigned char)*s)) s++;
    while (e > s && py_space((unsigned char)e[-1])) e--;
    /* ([0-9]+)(\.[0-9]+)? */
    u128 mantissa = 0;
    int digits = 0, frac_digits = 0;
    const char *p = s;
    while (p < e && isdigit((unsigned char)*p)) {
        if (mantissa > (((u128)-1) - 9) / 10) {
            *why = "out of range";
            return -1;
        }
        mantissa = mantissa * 10 + (u128)(*p - '0');
        digits++;
        p++;
    }
    if (digits == 0) return -1;
    if (p < e && *p == '.') {
        p++;
        while (p < e && isdigit((unsigned char)*p)) {
            if (mantissa > (((u128)-1) - 9) / 10 || frac_digits >= 38) {
                *why = "out of range";
                return -1;
            }
            mantissa = mantissa * 10 + (u128)(*p - '0');
            frac_digits++;
            p++;
        }
        if (frac_digits == 0) return -1;
    }
    uint64_t mult = 1;
    size_t rest = (size_t)(e - p);
    if (rest > 0) {
        size_t i;
        for (i = 0; i < sizeof multipliers / sizeof multipliers[0]; i++) {
            if (strlen(multipliers[i].suffix) == rest && memcmp(p, multipliers[i].suffix, rest) == 0) break;
        }
        if (i == sizeof multipliers / sizeof multipliers[0]) return -1;
        mult = multipliers[i].mult;
    }
    if (mantissa > ((u128)-1) / mult) {
        *why = "out of range";
        return -1;
    }
    u128 scaled = mantissa * mult, pow10 = 1;
    for (int i = 0; i < frac_digits; i++) pow10 *= 10;
    if (scaled % pow10 != 0) {
        *why = "not a whole number of bytes";
        return -1;
    }
    u128 value = scaled / pow10;
    if (value > (u128)UINT64_MAX) {
        *why = "out of range";
        return -1;
    }
    *out = (uint64_t)value;
    return 0;
}

static int parse_bool(const char *var, const char *v, int *out) {
    if (v == NULL || *v == '\0' || !strcasecmp(v, "false") || !strcmp(v, "0")) {
        *out = 0;
        return 0;
    }
    if (!strcasecmp(v, "true") || !strcmp(v, "1")) {
        *out = 1;
        return 0;
    }
    vgpu_config_error(var, v, "not a boolean", "true, false, 1, 0");
    return -1;
}

static int parse_limit(const char *var, const char *v, uint64_t *out) {
    const char *why;
    if (vgpu_parse_bytes(v, out, &why) != 0) {
        vgpu_config_error(var, v, why, vgpu_quantity_forms);
        return -1;
    }
    return 0;
}

int vgpu_indexed_settings(const char *prefix, vgpu_setting_parser parse, uint64_t out[VGPU_MAX_DEVICES],
                          int have[VGPU_MAX_DEVICES]) {
    size_t plen = strlen(prefix);
    uint64_t all = 0;
    int have_all = 0;
    uint64_t per[VGPU_MAX_DEVICES] = {0};
    int have_per[VGPU_MAX_DEVICES] = {0};
    /* Walk the entries once: catches PREFIX_<junk> and indices beyond VGPU_MAX_DEVICES, which a
     * lookup of the known names would silently miss. An empty value is parsed like any other
     * (and refused): "set but empty" never means "no limit". */
    for (char **ep = vgpu_setting_entries(); ep != NULL && *ep != NULL; ep++) {
        const char *kv = *ep;
        if (strncmp(kv, prefix, plen) != 0) continue;
        const char *rest = kv + plen;
        const char *eq = strchr(rest, '=');
        if (eq == NULL) continue;
        char name[96];
        size_t nlen = (size_t)(eq - kv);
        if (nlen >= sizeof name) nlen = sizeof name - 1;
        memcpy(name, kv, nlen);
        name[nlen] = '\0';
        if (rest == eq) {
            if (parse(name, eq + 1, &all) != 0) return -1;
            have_all = 1;
            continue;
        }
        if (*rest != '_') continue; /* another variable that merely starts with the prefix */
        const char *idx = rest + 1;
        long i = -1;
        if (idx < eq && (size_t)(eq - idx) <= 2) {
            i = 0;
            for (const char *q = idx; q < eq; q++) {
                if (!isdigit((unsigned char)*q)) {
                    i = -1;
                    break;
                }
                i = i * 10 + (*q - '0');
            }
        }
        if (i < 0 || i >= VGPU_MAX_DEVICES) {
            char allowed[96];
            snprintf(allowed, sizeof allowed, "%s_<i> with i in 0..%d", prefix, VGPU_MAX_DEVICES - 1);
            vgpu_config_error(name, eq + 1, "not a device index", allowed);
            return -1;
        }
        if (parse(name, eq + 1, &per[i]) != 0) return -1;
        have_per[i] = 1;
    }
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        out[i] = have_per[i] ? per[i] : (have_all ? all : 0);
        if (have) have[i] = have_per[i] || have_all;
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
    if (parse_bool("CUDA_DISABLE_CONTROL", vgpu_setting("CUDA_DISABLE_CONTROL"), &cfg->disabled) != 0) return -1;
    if (cfg->disabled) return 0; /* pure passthrough: nothing else matters */

    if (vgpu_indexed_settings("CUDA_DEVICE_MEMORY_LIMIT", parse_limit, cfg->limit, NULL) != 0) return -1;
    /* 0 means "no limit" (as in HAMi-core): CUDA_DEVICE_MEMORY_LIMIT_1=0 exempts device 1. */
    for (int i = 0; i < VGPU_MAX_DEVICES; i++)
        if (cfg->limit[i] != 0) cfg->any_limit = 1;

    v = vgpu_setting("VGPU_CONTEXT_RESERVE");
    if (v != NULL && parse_limit("VGPU_CONTEXT_RESERVE", v, &cfg->context_reserve) != 0) return -1;
    /* the size a context takes on each device, handed over by the plugin (ctxmem.c) */
    if (vgpu_indexed_settings("VGPU_CONTEXT_SIZE", parse_limit, cfg->context_size, NULL) != 0) return -1;

    v = vgpu_setting("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    cfg->region_path = (v != NULL && *v != '\0') ? strdup(v) : NULL; /* env may change later */
    return 0;
}

int vgpu_config_load(void) { return load(&loaded); }

/*
 * What a set of settings makes the shim enforce (enforced.h): the memory quota and compute cap
 * of each device, the policy, the priority. Pure, so that the shim and `vgpu run` (through the
 * Python binding) resolve the same settings the same way: defaults, precedences (PREFIX_<i> over
 * PREFIX, VGPU_COMPUTE_POLICY over HAMi's GPU_CORE_UTILIZATION_POLICY, VGPU_PRIORITY over
 * CUDA_TASK_PRIORITY) and refusals (a malformed value is never "no limit").
 */
#include "enforced.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "vgpu/compute_state.h" /* VGPU_COMPUTE_POLICY_* */

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

/* == sharing.percent.FORMS; the cases both sides accept: tests/support/percent_cases.py */
static const char cap_forms[] = "a percentage 0-100 (e.g. 30 or 12.5; 0 or 100 = no cap)";

/* Percent -> permille: [0-9]+(.[0-9]+)? with an optional '%' and surrounding blanks (no hex, no
 * exponent, no sign: strtod's extra forms are refused), at most 100: a typo such as 300 must not
 * turn the cap off. 0 ok (*out: 0 = no cap), -1 malformed or above 100. */
static int parse_percent(const char *v, uint32_t *out) {
    const char *p = v;
    while (*p == ' ' || *p == '\t') p++;
    const char *start = p;
    while (*p >= '0' && *p <= '9') p++;
    if (p == start) return -1;
    if (*p == '.') {
        const char *frac = ++p;
        while (*p >= '0' && *p <= '9') p++;
        if (p == frac) return -1;
    }
    const char *end = p;
    if (*p == '%') p++;
    while (*p == ' ' || *p == '\t') p++;
    if (*p || end - start > 32) return -1;
    char num[40];
    memcpy(num, start, (size_t)(end - start));
    num[end - start] = '\0';
    double d = strtod(num, NULL);
    if (!isfinite(d) || d > 100.0) return -1;
    if (d == 100.0 || d == 0.0) {
        *out = 0;
        return 0;
    }
    long pm = lround(d * 10.0);
    if (pm < 1) pm = 1; /* 0.01% still means "capped", never "uncapped" */
    if (pm > 999) pm = 999;
    *out = (uint32_t)pm;
    return 0;
}

static void fault_at(struct vgpu_setting_fault *f, const char *var, size_t var_len, const char *value, const char *why,
                     const char *forms) {
    if (var_len >= sizeof f->var) var_len = sizeof f->var - 1;
    memcpy(f->var, var, var_len);
    f->var[var_len] = '\0';
    snprintf(f->value, sizeof f->value, "%s", value ? value : "");
    f->why = why;
    f->forms = forms;
}

static void fault(struct vgpu_setting_fault *f, const char *var, const char *value, const char *why,
                  const char *forms) {
    fault_at(f, var, strlen(var), value, why, forms);
}

const char *vgpu_entry(char **entries, const char *name) {
    size_t len = strlen(name);
    for (char **e = entries; e != NULL && *e != NULL; e++)
        if (strncmp(*e, name, len) == 0 && (*e)[len] == '=') return *e + len + 1;
    return NULL;
}

int vgpu_indexed_values(char **entries, const char *prefix, vgpu_value_parser parse, uint64_t out[VGPU_MAX_DEVICES],
                        int have[VGPU_MAX_DEVICES], struct vgpu_setting_fault *f) {
    size_t plen = strlen(prefix);
    uint64_t all = 0;
    int have_all = 0;
    uint64_t per[VGPU_MAX_DEVICES] = {0};
    int have_per[VGPU_MAX_DEVICES] = {0};
    const char *why = NULL, *forms = NULL;
    /* Walk the entries once: catches PREFIX_<junk> and indices beyond VGPU_MAX_DEVICES, which a
     * lookup of the known names would silently miss. An empty value is parsed like any other
     * (and refused): "set but empty" never means "no limit". */
    for (char **ep = entries; ep != NULL && *ep != NULL; ep++) {
        const char *kv = *ep;
        if (strncmp(kv, prefix, plen) != 0) continue;
        const char *rest = kv + plen;
        const char *eq = strchr(rest, '=');
        if (eq == NULL) continue;
        size_t nlen = (size_t)(eq - kv);
        if (rest == eq) {
            if (parse(eq + 1, &all, &why, &forms) != 0) goto refused;
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
            char *allowed = f->forms_buf; /* the fault's own: no state shared between callers */
            snprintf(allowed, sizeof f->forms_buf, "%s_<i> with i in 0..%d", prefix, VGPU_MAX_DEVICES - 1);
            why = "not a device index";
            forms = allowed;
            goto refused;
        }
        if (parse(eq + 1, &per[i], &why, &forms) != 0) goto refused;
        have_per[i] = 1;
        continue;
    refused:
        fault_at(f, kv, nlen, eq + 1, why, forms);
        return -1;
    }
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        out[i] = have_per[i] ? per[i] : (have_all ? all : 0);
        if (have) have[i] = have_per[i] || have_all;
    }
    return 0;
}

int vgpu_quantity_value(const char *value, uint64_t *out, const char **why, const char **forms) {
    *forms = vgpu_quantity_forms;
    return vgpu_parse_bytes(value, out, why);
}

static int cap_value(const char *value, uint64_t *out, const char **why, const char **forms) {
    uint32_t pm;
    *why = "not a percentage";
    *forms = cap_forms;
    if (parse_percent(value, &pm)) return -1;
    *out = pm;
    return 0;
}

static int parse_int(const char *v, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v) return -1;
    while (*end == ' ' || *end == '\t') end++;
    if (*end || x < lo || x > hi) return -1;
    *out = x;
    return 0;
}

static const struct {
    const char *name;
    uint32_t policy;
} policies[] = {
    {"hard", VGPU_COMPUTE_POLICY_HARD},
    {"elastic", VGPU_COMPUTE_POLICY_ELASTIC},
    {"off", VGPU_COMPUTE_POLICY_OFF},
    /* HAMi's GPU_CORE_UTILIZATION_POLICY names */
    {"force", VGPU_COMPUTE_POLICY_HARD},
    {"default", VGPU_COMPUTE_POLICY_ELASTIC},
    {"disable", VGPU_COMPUTE_POLICY_OFF},
};

/* name's policy among policies[first..first+3) (case-insensitive): 0, or -1 unknown */
static int policy_named(const char *name, size_t first, uint32_t *out) {
    for (size_t i = first; i < first + 3; i++)
        if (!strcasecmp(name, policies[i].name)) {
            *out = policies[i].policy;
            return 0;
        }
    return -1;
}

int vgpu_enforced_resolve(char **entries, struct vgpu_enforced *out, struct vgpu_setting_fault *f) {
    const char *v;
    int rc = -1;
    uint64_t caps[VGPU_MAX_DEVICES];
    memset(out, 0, sizeof *out);
    out->policy = VGPU_COMPUTE_POLICY_HARD;
    out->priority = 1;

    v = vgpu_entry(entries, "CUDA_DISABLE_CONTROL");
    if (v != NULL && *v != '\0' && strcasecmp(v, "false") && strcmp(v, "0")) {
        if (strcasecmp(v, "true") && strcmp(v, "1")) {
            fault(f, "CUDA_DISABLE_CONTROL", v, "not a boolean", "true, false, 1, 0");
            goto done;
        }
        out->disabled = 1; /* pure passthrough: nothing else matters */
        rc = 0;
        goto done;
    }
    /* 0 means "no limit" (as in HAMi-core): CUDA_DEVICE_MEMORY_LIMIT_1=0 exempts device 1. */
    if (vgpu_indexed_values(entries, "CUDA_DEVICE_MEMORY_LIMIT", vgpu_quantity_value, out->memory, NULL, f)) goto done;
    if (vgpu_indexed_values(entries, "CUDA_DEVICE_SM_LIMIT", cap_value, caps, NULL, f)) goto done;
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) out->cap[i] = (uint32_t)caps[i];

    if ((v = vgpu_entry(entries, "VGPU_COMPUTE_POLICY")) && *v) {
        if (policy_named(v, 0, &out->policy)) {
            fault(f, "VGPU_COMPUTE_POLICY", v, "unknown policy", "hard, elastic or off");
            goto done;
        }
    } else if ((v = vgpu_entry(entries, "GPU_CORE_UTILIZATION_POLICY")) && *v) {
        if (policy_named(v, 3, &out->policy)) {
            fault(f, "GPU_CORE_UTILIZATION_POLICY", v, "unknown policy",
                  "force (= hard), default (= elastic) or disable (= off)");
            goto done;
        }
    }

    const char *pname = "VGPU_PRIORITY";
    if (!((v = vgpu_entry(entries, pname)) && *v)) {
        pname = "CUDA_TASK_PRIORITY";
        v = vgpu_entry(entries, pname);
    }
    if (v && *v) {
        long x;
        if (parse_int(v, -100, 100, &x)) {
            fault(f, pname, v, "not an integer in range",
                  "an integer -100..100, lower = higher priority (0 high, 1 default)");
            goto done;
        }
        out->priority = (int32_t)x;
    }
    rc = 0;
done:
    return rc;
}

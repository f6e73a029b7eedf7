/*
 * The compute cap's settings (docs/compute.md): CUDA_DEVICE_SM_LIMIT[_i], the policy, the
 * priority, where elastic demand is exchanged, the NVML outer loop. Parsed once, fail closed:
 * a malformed value is reported in one line and cuInit fails, never "no cap".
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "compute_config.h"
#include "demand.h"
#include "config.h"
#include "log.h"
#include "settings.h"

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

static int parse_cap_setting(const char *var, const char *v, uint64_t *out) {
    uint32_t pm;
    if (parse_percent(v, &pm)) {
        vgpu_config_error(var, v, "not a percentage", cap_forms);
        return -1;
    }
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

int vgpu_compute_config_load(struct vgpu_compute_config *c) {
    const char *v;
    uint64_t caps[VGPU_MAX_DEVICES];
    if (vgpu_indexed_settings("CUDA_DEVICE_SM_LIMIT", parse_cap_setting, caps, NULL)) return -1;
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) c->cap[i] = (uint32_t)caps[i];

    c->policy = VGPU_COMPUTE_POLICY_HARD;
    if ((v = vgpu_setting("VGPU_COMPUTE_POLICY")) && *v) {
        if (!strcasecmp(v, "hard"))
            c->policy = VGPU_COMPUTE_POLICY_HARD;
        else if (!strcasecmp(v, "elastic"))
            c->policy = VGPU_COMPUTE_POLICY_ELASTIC;
        else if (!strcasecmp(v, "off"))
            c->policy = VGPU_COMPUTE_POLICY_OFF;
        else {
            vgpu_config_error("VGPU_COMPUTE_POLICY", v, "unknown policy", "hard, elastic or off");
            return -1;
        }
    } else if ((v = vgpu_setting("GPU_CORE_UTILIZATION_POLICY")) && *v) {
        if (!strcasecmp(v, "force"))
            c->policy = VGPU_COMPUTE_POLICY_HARD;
        else if (!strcasecmp(v, "default"))
            c->policy = VGPU_COMPUTE_POLICY_ELASTIC;
        else if (!strcasecmp(v, "disable"))
            c->policy = VGPU_COMPUTE_POLICY_OFF;
        else {
            vgpu_config_error("GPU_CORE_UTILIZATION_POLICY", v, "unknown policy",
                              "force (= hard), default (= elastic) or disable (= off)");
            return -1;
        }
    }

    c->priority = 1;
    const char *pname = "VGPU_PRIORITY";
    if (!((v = vgpu_setting(pname)) && *v)) {
        pname = "CUDA_TASK_PRIORITY";
        v = vgpu_setting(pname);
    }
    if (v && *v) {
        long x;
        if (parse_int(v, -100, 100, &x)) {
            vgpu_config_error(pname, v, "not an integer in range",
                              "an integer -100..100, lower = higher priority (0 high, 1 default)");
            return -1;
        }
        c->priority = (int32_t)x;
    }

    /* Where elastic demand is exchanged. Under a limits file only the plugin's directory counts
     * (no default: a slice that could choose a directory without neighbours would lend itself
     * their share). */
    char dir[512] = "";
    int default_dir = 0;
    if ((v = vgpu_setting("VGPU_NODE_STATE_DIR")) && *v) {
        if (v[0] != '/' || strlen(v) >= sizeof dir - 64) {
            vgpu_config_error("VGPU_NODE_STATE_DIR", v, "not an absolute path (or too long)",
                              "an absolute directory path");
            return -1;
        }
        snprintf(dir, sizeof dir, "%s", v);
    } else if (!vgpu_settings_file()) {
        const char *run = getenv("XDG_RUNTIME_DIR");
        if (run && run[0] == '/' && strlen(run) < sizeof dir - 64)
            snprintf(dir, sizeof dir, "%s/vgpu-node", run);
        else
            snprintf(dir, sizeof dir, "/tmp/vgpu-node-%u", (unsigned)geteuid());
        default_dir = 1;
    }
    const char *own = vgpu_setting("VGPU_DEMAND_FILE");
    if (own && *own && (own[0] != '/' || strlen(own) >= 500)) {
        vgpu_config_error("VGPU_DEMAND_FILE", own, "not an absolute path (or too long)", "an absolute file path");
        return -1;
    }
    vgpu_demand_configure(dir, own, default_dir);

    c->nvml_loop = 1;
    if ((v = vgpu_setting("VGPU_COMPUTE_NVML")) && *v) {
        if (!strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "on"))
            c->nvml_loop = 1;
        else if (!strcmp(v, "0") || !strcasecmp(v, "false") || !strcasecmp(v, "off"))
            c->nvml_loop = 0;
        else {
            vgpu_config_error("VGPU_COMPUTE_NVML", v, "not a boolean", "1, true, on, 0, false or off");
            return -1;
        }
    }

    c->enabled = 0;
    if (c->policy != VGPU_COMPUTE_POLICY_OFF)
        for (int i = 0; i < VGPU_MAX_DEVICES; i++)
            if (c->cap[i]) c->enabled = 1;
    return 0;
}

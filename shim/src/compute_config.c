/*
 * The compute cap's settings (docs/compute.md): CUDA_DEVICE_SM_LIMIT[_i], the policy, the
 * priority, where elastic demand is exchanged, the NVML outer loop. Parsed once, fail closed:
 * a malformed value is reported in one line and cuInit fails, never "no cap".
 */
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

int vgpu_compute_config_load(struct vgpu_compute_config *c) {
    const char *v;
    /* resolved with the memory quotas by vgpu_config_load (enforced.c) */
    const struct vgpu_enforced *e = &vgpu_config()->enforced;
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) c->cap[i] = e->cap[i];
    c->policy = e->policy;
    c->priority = e->priority;

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

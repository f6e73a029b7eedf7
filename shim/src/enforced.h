/* What a set of settings makes the shim enforce (enforced.c): the memory quota and compute cap
 * of each device, the compute policy and the priority, with the shim's defaults and precedences.
 * Pure (no global state, no logging, no CUDA): compiled into the shim (config.c,
 * compute_config.c) and into the Python binding, so `vgpu run` shows and writes exactly what the
 * shim will enforce instead of re-deriving it. */
#ifndef VGPU_ENFORCED_H
#define VGPU_ENFORCED_H

#include <stdint.h>

#include "vgpu/region.h" /* VGPU_MAX_DEVICES */

/* CFFI-BEGIN */
struct vgpu_enforced {
    int disabled;                      /* CUDA_DISABLE_CONTROL=true: passthrough, nothing else read */
    uint64_t memory[VGPU_MAX_DEVICES]; /* bytes per app-visible device index; 0 = no quota */
    uint32_t cap[VGPU_MAX_DEVICES];    /* compute cap in permille; 0 = none */
    uint32_t policy;                   /* VGPU_COMPUTE_POLICY_* */
    int32_t priority;                  /* -100..100, lower is served first */
};

/* A refused setting, for one line: VAR="value" is invalid (why); accepted: forms. */
struct vgpu_setting_fault {
    char var[96];
    char value[160]; /* cut to fit */
    const char *why;
    const char *forms;  /* a constant, or forms_buf */
    char forms_buf[96]; /* forms made for this fault (a device index's range) */
};

/* Resolve *out from entries ("K=V", NULL-terminated: the environment or the limits file's): 0, or
 * -1 with *fault naming the first setting refused. A malformed value is never "no limit". */
int vgpu_enforced_resolve(char **entries, struct vgpu_enforced *out, struct vgpu_setting_fault *fault);
/* CFFI-END */

/* The first entry's value for name (as getenv), or NULL. */
const char *vgpu_entry(char **entries, const char *name);

/* PREFIX (every device) and PREFIX_<i> (device i, 0..VGPU_MAX_DEVICES-1) from entries: out[i] is
 * device i's parsed value (PREFIX_<i> over PREFIX, 0 when neither is set), have[i] (may be NULL)
 * whether one was set. Another index, or a value `parse` refuses, fills *fault and returns -1. */
typedef int (*vgpu_value_parser)(const char *value, uint64_t *out, const char **why, const char **forms);
int vgpu_indexed_values(char **entries, const char *prefix, vgpu_value_parser parse, uint64_t out[VGPU_MAX_DEVICES],
                        int have[VGPU_MAX_DEVICES], struct vgpu_setting_fault *fault);

/* Memory quantity: exactly the forms of sharing/quantity.py. 0 ok, -1 malformed or out of range
 * (then *why says which). */
int vgpu_parse_bytes(const char *text, uint64_t *out, const char **why);
extern const char vgpu_quantity_forms[];
/* A vgpu_value_parser of memory quantities. */
int vgpu_quantity_value(const char *value, uint64_t *out, const char **why, const char **forms);

#endif

/* Bursting (burst.c; docs/policy.md "Memory that bursts and is given back"): a slice may use up to
 * request + min(limit - request, grant) on a device, its grant read from the plugin's pool file. */
#ifndef VGPU_BURST_H
#define VGPU_BURST_H

#include <stdint.h>

/* Map the pool file when some device bursts (vgpu_config()->any_burst). 0, or -1 after the one
 * config-error line (fail closed: not the plugin's file, wrong size, magic or layout). */
int vgpu_burst_open(void);
/* Whether device index dev may borrow (a limit above its request and an open pool). */
int vgpu_burst_on(int dev);
/* What the slice may use on dev now: its request, plus what it may borrow (0 without bursting, or
 * when its grant entry is not its own, free, or held by a writer through every read). */
uint64_t vgpu_burst_bound(int dev);
/* The device's burst limit (0: none). */
uint64_t vgpu_burst_limit(int dev);

#endif

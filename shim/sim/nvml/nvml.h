/*
 * The simulated libnvidia-ml.so.1's init/shutdown, system and device queries (nvml.c): its process
 * globals and the device handle checks the other files call.
 *
 *   nvml.c     init/shutdown, system and device queries (identity, PCI, memory)
 *   procs.c    running processes, utilisation (device and per process)
 *   events.c   event sets: XID critical errors of unhealthy devices
 *   nvlink.c   NVLink queries (no links between the simulated GPUs)
 *   errors.c   nvmlErrorString
 *
 * NVML reads the same SIMGPU_CONFIG (re-read at every nvmlInit) and the same node state as the
 * simulated libcuda: memory used and processes come from the process slots, utilisation from the
 * busy-time rings the launches fill.
 */
#ifndef VGPU_SIM_NVML_NVML_H
#define VGPU_SIM_NVML_NVML_H

/* Exported, but bound inside this library ("protected"): the simulator never calls its own
 * entry points through the dynamic symbol table, so an interposer (LD_PRELOAD) sees exactly the
 * application's calls, and cuGetProcAddress returns this library's own functions, as the real
 * driver does. */
#define SIM_EXPORT    __attribute__((visibility("protected")))
#define VGPU_NVML_API extern SIM_EXPORT
#include "vgpu/nvml_api.h"

#include "../common/config.h"

#include <pthread.h>
#include <stdint.h>

struct nvmlDevice_st {
    int index;
};

typedef struct {
    pthread_mutex_t lock; /* guards everything below */
    int refcount;         /* nvmlInit minus nvmlShutdown */
    sim_config cfg;
    int64_t cfg_mtime; /* for health refresh during event waits */
    struct nvmlDevice_st devs[SIM_MAX_DEVICES];
} nvml_globals;
extern nvml_globals N;

/* Check init and the handle; on success *idx is the device index and *cfg a copy of its config. */
nvmlReturn_t sim_nvml_device(nvmlDevice_t h, int *idx, sim_device_cfg *cfg);
nvmlReturn_t sim_nvml_check_init(void);
uint64_t sim_nvml_period_ns(void); /* SIMGPU_UTIL_PERIOD_MS, default 1000 */

#endif

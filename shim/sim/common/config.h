/*
 * SIMGPU_CONFIG -> sim_config: devices, driver and CUDA versions, with defaults (config.c).
 */
#ifndef VGPU_SIM_CONFIG_H
#define VGPU_SIM_CONFIG_H

#include <stdint.h>

#define SIM_MAX_DEVICES 128 /* a node of the simulator: more than any real one, past the shim's 64 */
#define SIM_NAME_LEN    96
#define SIM_UUID_LEN    64

typedef struct {
    char name[SIM_NAME_LEN];
    char uuid[SIM_UUID_LEN]; /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    unsigned char uuid_bytes[16];
    uint64_t memory; /* bytes */
    int sm_count;
    unsigned pci_domain, pci_bus, pci_device;
    int numa_node; /* -1: none */
    int cc_major, cc_minor;
    int healthy;
    unsigned long long xid; /* delivered while unhealthy */
    unsigned minor;
} sim_device_cfg;

typedef struct {
    int ndev;
    sim_device_cfg dev[SIM_MAX_DEVICES];
    char driver_version[80];
    int cuda_version;          /* 12080 = 12.8 */
    char path[512];            /* the file read, "" for the built-in default */
    int phys[SIM_MAX_DEVICES]; /* libcuda: CUDA ordinal -> node device index (CUDA_DEVICE_ORDER,
                                   * CUDA_VISIBLE_DEVICES) */
} sim_config;

/* Devices are in PCI bus order (as NVML enumerates them), whatever order the file lists them in.
 * Read SIMGPU_CONFIG (or build the default H100). On a malformed file prints one stderr line
 * naming the file, the field and what is allowed, and returns -1. */
int sim_config_load(sim_config *out);
/* Re-read only health ("healthy", "xid") of the devices of an already loaded config, if the file
 * changed since `*mtime_ns` (NVML event waits use it to see health flip while they wait). */
void sim_config_refresh_health(sim_config *cfg, int64_t *mtime_ns);
int64_t sim_config_mtime_ns(const char *path);
/* Order of two devices by PCI bus id (domain, bus, device): <0, 0, >0. */
int sim_pci_cmp(const sim_device_cfg *a, const sim_device_cfg *b);

#endif

/*
 * cuInit and the process-wide state of the simulated driver.
 *
 * cuInit reads SIMGPU_CONFIG (again at every call while the process has no context, so tests can
 * change the node between runs) and maps the node state. A malformed config makes cuInit fail
 * with CUDA_ERROR_NO_DEVICE after one stderr line naming the file, the field and what is allowed.
 *
 * CUDA_DEVICE_ORDER is honoured as by the real driver: PCI_BUS_ID numbers the devices in PCI bus
 * order (NVML's order); FASTEST_FIRST, unset or any other value, fastest first (see
 * device_speed). CUDA_VISIBLE_DEVICES is honoured as by the real driver: a comma-separated list
 * of device indices (into that CUDA order) or (prefixes of) GPU UUIDs; the list ends at the first invalid or repeated entry; an
 * empty value hides every device. CUDA ordinals then number the visible devices, while memory is
 * charged, and NVML (which ignores the variable) reports it, on the physical device.
 *
 * Fork (fork.c): a child starts with no CUDA state (as with the real driver, the parent's
 * contexts are unusable there): every handle of the parent becomes invalid (generation bump), the
 * child has no node slot (the parent's slot lock is not inherited) and must call cuInit again;
 * its first context claims a slot of its own.
 */
#include "init.h"

#include "../common/config.h"
#include "../common/state.h"
#include "../common/util.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

static const sim_config empty_config; /* no devices until cuInit succeeds */
sim_globals G = {.lock = PTHREAD_MUTEX_INITIALIZER, .slot = -1, .gen = 1, .cfg = &empty_config};

void sim_init_after_fork_child(void) {
    pthread_mutex_init(&G.lock, NULL);
    atomic_fetch_add(&G.gen, 1);
    atomic_store(&G.initialized, 0);
    G.slot = -1;
    G.live_contexts = 0;
    memset(G.primary, 0, sizeof G.primary);
    memset(G.default_pool, 0, sizeof G.default_pool);
    memset(G.current_pool, 0, sizeof G.current_pool);
}

/* SIMGPU_CONTEXT_MEMORY (bytes or a quantity such as 300Mi; 0 models a context that costs nothing). */
static uint64_t context_memory_knob(void) { return sim_env_u64("SIMGPU_CONTEXT_MEMORY", 500ull << 20); }

/* SIMGPU_ALLOC_GRANULARITY: the device memory page size (memory.c), checked. */
static uint64_t alloc_granularity_knob(void) {
    uint64_t g = sim_env_u64("SIMGPU_ALLOC_GRANULARITY", 2ull << 20);
    if (g < SIM_ALLOC_ALIGN || g > (1ull << 30) || (g & (g - 1))) {
        sim_log("environment SIMGPU_ALLOC_GRANULARITY=%llu: allowed: a power of two from 512 to 1Gi; using 2Mi",
                (unsigned long long)g);
        g = 2ull << 20;
    }
    return g;
}

CUresult sim_check_init(void) {
    return atomic_load_explicit(&G.initialized, memory_order_acquire) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult sim_check_device(CUdevice dev) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (dev < 0 || dev >= G.cfg->ndev) return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

/* "Compute power" of a device for FASTEST_FIRST: SMs times compute capability (9.0 -> 90).
 * NVIDIA's heuristic is undocumented in detail; this is a simple deterministic stand-in. */
static long device_speed(const sim_device_cfg *d) { return (long)d->sm_count * (d->cc_major * 10 + d->cc_minor); }

/* order[k] = node index of the k-th device in CUDA's enumeration order (before
 * CUDA_VISIBLE_DEVICES). Node indices are in PCI bus order (config.c), so PCI_BUS_ID is the
 * identity; FASTEST_FIRST (the default, and any unknown value, which the real driver ignores)
 * sorts by speed descending, ties in PCI bus order (a stable sort of the PCI order). */
static void cuda_device_order(const sim_config *cfg, int *order) {
    for (int i = 0; i < cfg->ndev; i++) order[i] = i;
    const char *o = getenv("CUDA_DEVICE_ORDER");
    if (o && strcmp(o, "PCI_BUS_ID") == 0) return;
    for (int i = 1; i < cfg->ndev; i++) {
        int x = order[i], j = i;
        for (; j > 0 && device_speed(&cfg->dev[order[j - 1]]) < device_speed(&cfg->dev[x]); j--)
            order[j] = order[j - 1];
        order[j] = x;
    }
}

/* Number the devices in CUDA order and narrow `cfg` to those CUDA_VISIBLE_DEVICES shows (numeric
 * entries index the CUDA order); phys[i] = node index of ordinal i. */
static void apply_visible_devices(sim_config *cfg) {
    int *phys = cfg->phys;
    sim_device_cfg all[SIM_MAX_DEVICES];
    int order[SIM_MAX_DEVICES];
    int nall = cfg->ndev, n = 0;
    memcpy(all, cfg->dev, sizeof all);
    cuda_device_order(cfg, order);
    for (int i = 0; i < SIM_MAX_DEVICES; i++) phys[i] = i < nall ? order[i] : i;
    for (int i = 0; i < nall; i++) cfg->dev[i] = all[order[i]];
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    if (!v) return;
    char buf[1024];
    sim_copy_str(buf, sizeof buf, v);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok && n < SIM_MAX_DEVICES; tok = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*tok)) tok++;
        size_t len = strlen(tok);
        while (len && isspace((unsigned char)tok[len - 1])) tok[--len] = '\0';
        int idx = -1;
        if (len && isdigit((unsigned char)tok[0])) {
            char *end;
            long x = strtol(tok, &end, 10);
            if (*end == '\0' && x >= 0 && x < nall) idx = order[x];
        } else if (len > 4 && strncmp(tok, "GPU-", 4) == 0) {
            for (int i = 0; i < nall; i++) /* a unique UUID prefix selects the device */
                if (strncmp(all[i].uuid, tok, len) == 0) {
                    if (idx >= 0) {
                        idx = -1;
                        break;
                    }
                    idx = i;
                }
        }
        for (int j = 0; j < n && idx >= 0; j++)
            if (phys[j] == idx) idx = -1; /* repeated */
        if (idx < 0) break;
        phys[n] = idx;
        cfg->dev[n++] = all[idx];
    }
    cfg->ndev = n;
}

int sim_ensure_slot(void) {
    if (G.slot < 0) G.slot = sim_state_claim_slot();
    return G.slot;
}

SIM_EXPORT CUresult cuInit(unsigned int Flags) {
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&G.lock);
    if (G.live_contexts == 0) {
        sim_config *cfg = calloc(1, sizeof *cfg);
        if (!cfg) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (sim_config_load(cfg) != 0) {
            rc = CUDA_ERROR_NO_DEVICE;
            atomic_store(&G.initialized, 0);
            free(cfg);
        } else {
            apply_visible_devices(cfg);
            if (memcmp(cfg, G.cfg, sizeof *cfg) == 0) {
                free(cfg);
            } else {
                /* Publish a new immutable config; the old one is kept (never freed) because
                 * other threads may be reading it right now without a lock. */
                __atomic_store_n(&G.cfg, cfg, __ATOMIC_RELEASE);
            }
        }
    }
    if (rc == CUDA_SUCCESS && sim_state_open() != 0) rc = CUDA_ERROR_OPERATING_SYSTEM;
    if (rc == CUDA_SUCCESS && G.cfg->ndev == 0) rc = CUDA_ERROR_NO_DEVICE;
    if (rc == CUDA_SUCCESS) {
        G.ctx_mem = context_memory_knob();
        G.alloc_gran = alloc_granularity_knob();
        uint64_t cost = sim_env_u64("SIMGPU_LAUNCH_COST_NS", 3000);
        G.launch_cost_ns = cost > 1000000u ? 1000000u : cost; /* at most 1 ms */
        uint64_t ahead_us = sim_env_u64("SIMGPU_QUEUE_AHEAD_US", 20000);
        G.queue_ahead_ns = (ahead_us > 10000000u ? 10000000u : ahead_us) * 1000ull; /* at most 10 s */
        atomic_store_explicit(&G.initialized, 1, memory_order_release);
    }
    pthread_mutex_unlock(&G.lock);
    return rc;
}

SIM_EXPORT CUresult cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    /* Works before cuInit, as the real one does (CUDA 13's runtime asks first and refuses an
     * older driver): the configured version either way. */
    if (sim_check_init() == CUDA_SUCCESS) {
        *driverVersion = G.cfg->cuda_version;
        return CUDA_SUCCESS;
    }
    static _Atomic int early; /* read once: the file is re-read at cuInit */
    int v = atomic_load(&early);
    if (!v) {
        sim_config *cfg = calloc(1, sizeof *cfg);
        v = cfg && sim_config_load(cfg) == 0 ? cfg->cuda_version : 0;
        free(cfg);
        if (!v) return CUDA_ERROR_NOT_INITIALIZED; /* a malformed config: cuInit will say why */
        atomic_store(&early, v);
    }
    *driverVersion = v;
    return CUDA_SUCCESS;
}

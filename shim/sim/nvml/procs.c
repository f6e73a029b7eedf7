/*
 * Running processes and utilisation.
 *
 * Device utilisation ("gpu") is the busy fraction of the device timeline over the last sample
 * period (SIMGPU_UTIL_PERIOD_MS, default 1000 ms), summed over the complete 10 ms buckets of the
 * device's busy ring in that period. Memory utilisation is not modelled (0). Per-process samples
 * (nvmlDeviceGetProcessUtilization) give each process's busy fraction (50 ms buckets) over the
 * period since lastSeenTimeStamp (at most one sample period, at least one bucket).
 *
 * A process is listed on a device while it is alive and holds a context or memory there; dead
 * processes are reaped before listing (their memory returns to the pool). Its PID is the one the
 * kernel driver reports, the host's (sim_slot_host_pid): a watchdog on the host finds a
 * container's process under /proc whatever PID namespace the container has.
 */
#include "nvml.h"

#include "../common/observe.h"
#include "../common/sched.h"
#include "../common/state.h"
#include "../common/util.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    int slot;
    unsigned pid;
    unsigned long long used;
    const sim_obs_state *st; /* NULL: this process's own state; else an observed one */
    const sim_obs_proc *op;
} proc_entry;

/* The processes on a device: those of this process's own state, then those of the observed
 * states (SIMGPU_OBSERVE) the kernel names a PID for. *out is malloc'ed (free it), `obs` stays
 * open for their utilisation (sim_observe_close). Returns the count, -1 when out of memory. */
static int list_procs(int dev, uint64_t total, proc_entry **out, sim_obs_set *obs) {
    sim_observe_open(obs, dev, total);
    size_t cap = SIM_MAX_PROCS;
    for (int s = 0; s < obs->n; s++) cap += (size_t)obs->st[s].nproc;
    proc_entry *e = malloc(cap * sizeof *e);
    if (!e) {
        sim_observe_close(obs);
        return -1;
    }
    int n = 0;
    sim_state_lock();
    sim_state_reap_locked(-1);
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        sim_proc_slot *p = &sim_shm->proc[i];
        if (!sim_slot_active(i) || (p->contexts[dev] == 0 && p->used[dev] == 0)) continue;
        e[n++] = (proc_entry){.slot = i, .pid = (unsigned)sim_slot_host_pid(i, -1), .used = p->used[dev]};
    }
    sim_state_unlock();
    for (int s = 0; s < obs->n; s++)
        for (int j = 0; j < obs->st[s].nproc; j++) {
            const sim_obs_proc *op = &obs->st[s].proc[j];
            if (op->pid == 0) continue; /* no PID the kernel vouches for: never a recorded number */
            e[n++] = (proc_entry){.slot = op->slot, .pid = op->pid, .used = op->used, .st = &obs->st[s], .op = op};
        }
    *out = e;
    return n;
}

/* Shared by the v1, v2 and v3 forms: `stride` bytes per entry, `v1` for the short layout. */
static nvmlReturn_t running(nvmlDevice_t device, unsigned int *infoCount, void *infos, size_t stride, int v1) {
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    int dev;
    sim_device_cfg cfg;
    nvmlReturn_t rc = sim_nvml_device(device, &dev, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    proc_entry *e;
    sim_obs_set obs;
    int n = list_procs(dev, cfg.memory, &e, &obs);
    if (n < 0) return NVML_ERROR_MEMORY;
    sim_observe_close(&obs);
    if (!infos || *infoCount < (unsigned)n) {
        *infoCount = (unsigned)n;
        free(e);
        return n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        char *slot = (char *)infos + (size_t)i * stride;
        if (v1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)slot;
            p->pid = e[i].pid;
            p->usedGpuMemory = e[i].used;
        } else {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)slot;
            p->pid = e[i].pid;
            p->usedGpuMemory = e[i].used;
            p->gpuInstanceId = 0xFFFFFFFFu; /* no MIG */
            p->computeInstanceId = 0xFFFFFFFFu;
        }
    }
    *infoCount = (unsigned)n;
    free(e);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                nvmlProcessInfo_t *infos) {
    return running(device, infoCount, infos, sizeof(nvmlProcessInfo_t), 0);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                nvmlProcessInfo_v2_t *infos) {
    return running(device, infoCount, infos, sizeof(nvmlProcessInfo_v2_t), 0);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_v1_t *infos) {
    return running(device, infoCount, infos, sizeof(nvmlProcessInfo_v1_t), 1);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                 nvmlProcessInfo_t *infos) {
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    int dev;
    nvmlReturn_t rc = sim_nvml_device(device, &dev, NULL);
    if (rc == NVML_SUCCESS) *infoCount = 0; /* the simulated GPU runs no graphics */
    return rc;
}

static unsigned pct(uint64_t busy, uint64_t window) {
    if (!window) return 0;
    uint64_t p = (busy * 100 + window / 2) / window;
    return p > 100 ? 100u : (unsigned)p;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
    int dev;
    sim_device_cfg cfg;
    nvmlReturn_t rc = sim_nvml_device(device, &dev, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    uint64_t now = sim_now_ns(), window;
    uint64_t busy = sim_sched_busy_between(dev, -1, now - sim_nvml_period_ns(), now, &window);
    /* Each observed state runs a timeline of its own on the device: their busy times add up
     * (the percentage is capped at 100). */
    sim_obs_set obs;
    sim_observe_open(&obs, dev, cfg.memory);
    for (int s = 0; s < obs.n; s++) {
        uint64_t w;
        busy += sim_observe_busy(&obs.st[s], dev, NULL, now - sim_nvml_period_ns(), now, now, &w);
    }
    sim_observe_close(&obs);
    utilization->gpu = pct(busy, window);
    utilization->memory = 0;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                        nvmlProcessUtilizationSample_t *utilization,
                                                        unsigned int *processSamplesCount,
                                                        unsigned long long lastSeenTimeStamp) {
    if (!processSamplesCount) return NVML_ERROR_INVALID_ARGUMENT;
    int dev;
    sim_device_cfg cfg;
    nvmlReturn_t rc = sim_nvml_device(device, &dev, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    uint64_t now_us = sim_realtime_us(), now = sim_now_ns(), period = sim_nvml_period_ns();
    if (lastSeenTimeStamp >= now_us) return NVML_ERROR_NOT_FOUND; /* nothing newer than what the caller has seen */
    uint64_t span = (now_us - lastSeenTimeStamp) * 1000ull;
    if (lastSeenTimeStamp == 0 || span > period) span = period;
    if (span < 2 * SIM_PBUCKET_NS) span = 2 * SIM_PBUCKET_NS; /* at least one complete bucket */
    proc_entry *e;
    sim_obs_set obs;
    int n = list_procs(dev, cfg.memory, &e, &obs);
    if (n < 0) return NVML_ERROR_MEMORY;
    if (n == 0 || !utilization || *processSamplesCount < (unsigned)n) {
        free(e);
        sim_observe_close(&obs);
        if (n == 0) return NVML_ERROR_NOT_FOUND;
        *processSamplesCount = (unsigned)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        uint64_t window;
        uint64_t busy = e[i].st ? sim_observe_busy(e[i].st, dev, e[i].op, now - span, now, now, &window)
                                : sim_sched_busy_between(dev, e[i].slot, now - span, now, &window);
        utilization[i] =
            (nvmlProcessUtilizationSample_t){.pid = e[i].pid, .timeStamp = now_us, .smUtil = pct(busy, window)};
    }
    *processSamplesCount = (unsigned)n;
    free(e);
    sim_observe_close(&obs);
    return NVML_SUCCESS;
}

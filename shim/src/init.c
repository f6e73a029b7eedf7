/*
 * One-time setup, lazily at the first hooked call (never in a library constructor: a process that
 * never touches CUDA, like a shell in the container, pays nothing), and the cuInit hook.
 * Fail closed: a bad configuration or an unusable region makes cuInit and every memory hook
 * return the error instead of running unlimited.
 */
#include <pthread.h>
#include <stdio.h>
#include <time.h>

#include "init.h"
#include "burst.h"
#include "compute.h"
#include "config.h"
#include "devices.h"
#include "hooks.h"
#include "log.h"
#include "region.h"
#include "settings.h"
#include "symbols.h"
#include "track.h"

static CUresult init_status = CUDA_SUCCESS;
static pthread_once_t init_once_ctl = PTHREAD_ONCE_INIT;
static uint64_t setup_ns; /* what the first-call setup took (init + device map), for the debug line */

static uint64_t clock_ns(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}
static uint64_t mono_ns(void) { return clock_ns(CLOCK_MONOTONIC); }
static uint64_t cpu_ns(void) { return clock_ns(CLOCK_THREAD_CPUTIME_ID); }
static uint64_t setup_cpu_ns; /* the same, in CPU time of the calling thread (no scheduling waits) */
/* The thread's CPU clock is a system call (no vDSO): read only for the debug line that shows it,
 * from the end of the configuration's parsing (which sets the level) on. */
static int measure_cpu;

static void atfork_child(void) {
    vgpu_track_reset();
    vgpu_region_atfork_child();
}

static void init_once(void) {
    uint64_t t0 = mono_ns();
    if (vgpu_config_load() != 0) {
        init_status = CUDA_ERROR_INVALID_VALUE;
        return;
    }
    const struct vgpu_config *cfg = vgpu_config();
    measure_cpu = cfg->log_level >= VGPU_LOG_DEBUG;
    uint64_t c0 = measure_cpu ? cpu_ns() : 0;
    if (vgpu_resolve_cuda() != 0) {
        vgpu_log(VGPU_LOG_ERROR, "cannot load libcuda.so.1");
        init_status = CUDA_ERROR_NOT_INITIALIZED;
        return;
    }
    if (cfg->disabled) {
        vgpu_log(VGPU_LOG_INFO, "CUDA_DISABLE_CONTROL=true: passthrough");
        return;
    }
    if (vgpu_compute_init() != 0) {
        init_status = CUDA_ERROR_INVALID_VALUE;
        return;
    }
    vgpu_settings_report();
    if (cfg->any_limit || cfg->region_path != NULL || vgpu_region_required()) {
        struct vgpu_region_params rp = {.path = cfg->region_path};
        for (int d = 0; d < VGPU_MAX_DEVICES; d++) rp.limit[d] = cfg->limit[d];
        vgpu_settings_publish(&rp.limits_source, &rp.limits_dev, &rp.limits_ino, &rp.limits_hash);
        init_status = vgpu_region_open(&rp);
        if (init_status != CUDA_SUCCESS) return;
        if (vgpu_burst_open() != 0) {
            init_status = CUDA_ERROR_INVALID_VALUE;
            return;
        }
        pthread_atfork(NULL, NULL, atfork_child);
        int same = 1;
        for (int d = 1; d < VGPU_MAX_DEVICES; d++) same &= vgpu_region_limit(d) == vgpu_region_limit(0);
        for (int d = 0; d < (same ? 1 : VGPU_MAX_DEVICES); d++) {
            char q[32];
            uint64_t l = vgpu_region_limit(d);
            if (l == 0) continue;
            char who[32];
            vgpu_format_bytes(l, q, sizeof q);
            if (same)
                snprintf(who, sizeof who, "every device");
            else
                snprintf(who, sizeof who, "device %d", d);
            vgpu_log(VGPU_LOG_INFO, "%s: quota %s, accounting file %s", who, q,
                     cfg->region_path ? cfg->region_path : "(private)");
        }
    }
    setup_ns = mono_ns() - t0;
    if (measure_cpu) setup_cpu_ns = cpu_ns() - c0;
}

static int init_done; /* init_once has run: every later hook call is one atomic load */

CUresult vgpu_init(void) {
    if (__atomic_load_n(&init_done, __ATOMIC_ACQUIRE)) return init_status;
    pthread_once(&init_once_ctl, init_once);
    __atomic_store_n(&init_done, 1, __ATOMIC_RELEASE);
    return init_status;
}

CUresult hook_cuInit(unsigned int Flags) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuInit == NULL) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real_cuInit(Flags);
    if (rc == CUDA_SUCCESS && !vgpu_config()->disabled) {
        uint64_t c0 = measure_cpu ? cpu_ns() : 0, t0 = mono_ns();
        vgpu_devices_discover();
        uint64_t t = mono_ns() - t0;
        uint64_t c = measure_cpu ? cpu_ns() - c0 : 0;
        /* only the first cuInit's map is setup; later calls find it built */
        static int reported;
        if (!__atomic_exchange_n(&reported, 1, __ATOMIC_RELAXED)) {
            setup_ns += t;
            setup_cpu_ns += c;
            vgpu_log(VGPU_LOG_DEBUG, "setup took %llu ns", (unsigned long long)setup_ns);
            vgpu_log(VGPU_LOG_DEBUG, "setup cpu %llu ns", (unsigned long long)setup_cpu_ns);
        }
    }
    return rc;
}

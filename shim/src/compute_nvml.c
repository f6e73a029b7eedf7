/*
 * Compute (SM) cap: the NVML outer loop. compute.c hands it each capped device at attach and
 * reads back its correction of the cost estimates (compute_nvml.h); design:
 * docs/compute.md.
 *
 * Events measure what the slice's kernels took *including* the time other contexts held the
 * device meanwhile: the estimator rejects samples visibly inflated by a neighbour's time slice,
 * but a kernel longer than a slice is preempted in every run while a neighbour is busy, and then
 * every sample is inflated alike (a 20 ms kernel next to a busy neighbour measures about 40 ms).
 * The driver's per-process utilisation is not fooled. Once per second one process of the slice
 * (the one that wins the CAS on nvml_next_ns) sums the smUtil of the slice's processes on the
 * device and compares it with what the slice was *charged* over the same second: their ratio is
 * the bias of the measured costs, whatever its cause, and the cost factor (nvml_factor_ppm) moves
 * towards factor x ratio (VC_NVML_GAIN of the way; the law is vc_nvml_factor in
 * compute_controller.c, also run by the plant model of tests/c/compute_controller_test.c). Readings where the slice used under 5% of the device change nothing;
 * consecutive readings are summed until the sums differ by more than the integer rounding of one
 * smUtil reading (1 point), so that a bias smaller than that is corrected too, after a few periods;
 * a disagreement under 5% waits for three readings (vc_nvml_step), so one period's noise does not
 * move the factor; the factor rises only while the slice uses more than its cap in force (`eff`).
 * It runs on a helper thread (started at the first capped launch, sleeping between readings, all signals blocked) so that a
 * slow NVML call never delays a launch. PIDs are compared with the region's process slots: where
 * NVML reports PIDs of another namespace (a container without hostPID) our own PID is not found
 * and the loop turns itself off for that device.
 */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "compute_controller.h"
#include "compute_clock.h"
#include "compute_nvml.h"
#include "log.h"
#include "region.h"
#include "symbols.h"

/* ------------------------------------------------------------ tunables (docs/compute.md) */
#define NVML_PERIOD_NS (1000000000LL) /* one reading per second per slice */

/* ------------------------------------------------------------ per-device state */
/* One per device index, written once by vgpu_compute_nvml_attach (attached last, with release
 * order); nvdev and nvml_state belong to the helper thread. */
struct nvml_dev {
    int attached;
    char uuid[48]; /* "GPU-..." for NVML, "" when unknown */
    struct vgpu_compute_state *st;
    int64_t attached_ns; /* when this process attached: NVML's window must not reach before it */
    nvmlDevice_t nvdev;  /* NVML handle (helper thread only) */
    int nvml_state;      /* 0 not tried, 1 usable, -1 off for this device (helper thread only) */
    /* Consecutive readings of this process not yet acted on (vc_nvml_step; helper thread only) */
    struct vc_nvml_acc acc;
    int64_t acc_next_ns; /* nvml_next_ns as this process's last reading set it */
};
static struct nvml_dev g_nd[VGPU_MAX_DEVICES];
static int g_started; /* this process tried to start the helper thread */

void vgpu_compute_nvml_attach(int dev, const char *uuid, struct vgpu_compute_state *st) {
    struct nvml_dev *nd = &g_nd[dev];
    snprintf(nd->uuid, sizeof nd->uuid, "%s", uuid);
    nd->st = st;
    nd->attached_ns = vgpu_compute_now_ns();
    __atomic_store_n(&nd->attached, 1, __ATOMIC_RELEASE);
}

/* ------------------------------------------------------------ NVML */
typedef nvmlReturn_t (*pfn_nvml_init)(void);
typedef nvmlReturn_t (*pfn_nvml_by_uuid)(const char *, nvmlDevice_t *);
typedef nvmlReturn_t (*pfn_nvml_proc_util)(nvmlDevice_t, nvmlProcessUtilizationSample_t *, unsigned int *,
                                           unsigned long long);
static struct {
    pfn_nvml_by_uuid by_uuid;
    pfn_nvml_proc_util proc_util;
    int ok;
} nv;
static pthread_once_t nv_once = PTHREAD_ONCE_INIT;

static void nv_resolve(void) {
    pfn_nvml_init init = (pfn_nvml_init)vgpu_nvml_sym("nvmlInit_v2");
    nv.by_uuid = (pfn_nvml_by_uuid)vgpu_nvml_sym("nvmlDeviceGetHandleByUUID");
    nv.proc_util = (pfn_nvml_proc_util)vgpu_nvml_sym("nvmlDeviceGetProcessUtilization");
    nv.ok = init && nv.by_uuid && nv.proc_util && init() == NVML_SUCCESS;
    if (!nv.ok) vgpu_log(VGPU_LOG_INFO, "compute cap: NVML per-process utilisation unavailable; events only");
}

static uint64_t realtime_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ULL + (uint64_t)ts.tv_nsec / 1000;
}

#define NV_MAX_SAMPLES 512

/* The slice's share of the device over the last period, permille; -1 when unknown. */
static int nvml_slice_usage(struct nvml_dev *cd, int dev, int *nprocs) {
    *nprocs = 0;
    if (cd->nvml_state == 0) {
        cd->nvml_state = cd->uuid[0] && nv.by_uuid(cd->uuid, &cd->nvdev) == NVML_SUCCESS ? 1 : -1;
        if (cd->nvml_state < 0) vgpu_log(VGPU_LOG_INFO, "compute cap: device %d (%s) not found in NVML", dev, cd->uuid);
    }
    if (cd->nvml_state < 0) return -1;
    static nvmlProcessUtilizationSample_t smp[NV_MAX_SAMPLES]; /* helper thread only */
    unsigned int n = NV_MAX_SAMPLES;
    uint64_t since = realtime_us() - (uint64_t)(NVML_PERIOD_NS / 1000);
    if (nv.proc_util(cd->nvdev, smp, &n, since) != NVML_SUCCESS || n > NV_MAX_SAMPLES) return -1;
    struct vgpu_region *r = vgpu_region();
    unsigned self = (unsigned)getpid();
    double total = 0;
    int found_self = 0;
    /* Per PID the mean of its samples (a real driver may return several per PID). */
    for (unsigned i = 0; i < n; i++) {
        unsigned pid = smp[i].pid;
        int seen = 0;
        for (unsigned j = 0; j < i && !seen; j++) seen = smp[j].pid == pid;
        if (seen) continue;
        int mine = pid == self;
        if (!mine && r)
            for (int k = 0; k < VGPU_MAX_PROCS && !mine; k++)
                mine = __atomic_load_n(&r->procs[k].state, __ATOMIC_RELAXED) == VGPU_SLOT_LIVE &&
                       (unsigned)__atomic_load_n(&r->procs[k].pid, __ATOMIC_RELAXED) == pid;
        if (!mine) continue;
        found_self |= pid == self;
        double sum = 0;
        unsigned cnt = 0;
        for (unsigned j = i; j < n; j++)
            if (smp[j].pid == pid) {
                sum += smp[j].smUtil;
                cnt++;
            }
        total += sum / cnt;
        (*nprocs)++;
    }
    if (!found_self) {
        /* We launch on this device, so the driver must list us: its PIDs are not ours. */
        vgpu_log(VGPU_LOG_INFO,
                 "compute cap: NVML does not list this process (PID namespace?); "
                 "device %d is controlled by events only",
                 dev);
        cd->nvml_state = -1;
        return -1;
    }
    return (int)(total * 10.0 + 0.5);
}

static void nvml_step(int dev) {
    struct nvml_dev *cd = &g_nd[dev];
    struct vgpu_compute_state *st = cd->st;
    int64_t now = vgpu_compute_now_ns();
    int64_t next = __atomic_load_n(&st->nvml_next_ns, __ATOMIC_ACQUIRE);
    if (now < next) return;
    if (!__atomic_compare_exchange_n(&st->nvml_next_ns, &next, now + NVML_PERIOD_NS, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_RELAXED))
        return; /* another process of the slice reads this period */
    uint64_t la = __atomic_load_n(&st->launches, __ATOMIC_RELAXED);
    uint64_t la0 = __atomic_exchange_n(&st->nvml_launches_snap, la, __ATOMIC_RELAXED);
    int64_t ch = __atomic_load_n(&st->charged_ns, __ATOMIC_RELAXED);
    int64_t ch0 = __atomic_exchange_n(&st->nvml_charged_snap, ch, __ATOMIC_RELAXED);
    uint32_t eff = __atomic_load_n(&st->effective_permille, __ATOMIC_RELAXED);
    if (cd->nvml_state < 0 || la0 == 0 || ch0 == 0 || la <= la0 || eff == 0 || eff >= VC_PERMILLE_FULL)
        return; /* first reading, idle, or not capped */
    /* What the slice was charged since the previous reading, permille of the device. A previous
     * reading long ago (an earlier process of the slice, or none since the slice went idle) is
     * only a new starting point: the NVML window is the last period. */
    int64_t span = now - (next - NVML_PERIOD_NS);
    if (span < NVML_PERIOD_NS / 2 || span > NVML_PERIOD_NS * 3 / 2) return;
    /* This process's utilisation over a period it did not run all of reads low. */
    if (now - cd->attached_ns < 2 * NVML_PERIOD_NS) return;
    double charged = 1000.0 * (double)(ch - ch0) / (double)span;
    int nprocs;
    int usage = nvml_slice_usage(cd, dev, &nprocs);
    if (usage < 0) return;
    __atomic_store_n(&st->nvml_usage_permille, (uint32_t)usage, __ATOMIC_RELAXED);
    /* The readings are summed until they disagree by more than the rounding allows: a bias
     * smaller than one reading's rounding (a 70% slice charged 1% too much) adds up over a few
     * periods and is corrected, while rounding noise, which does not add up, is left alone.
     * Only consecutive periods read by this process count. */
    if (next != cd->acc_next_ns) cd->acc.periods = 0;
    cd->acc_next_ns = now + NVML_PERIOD_NS;
    double old = vgpu_compute_stored_factor_of(vgpu_compute_cost_factor_ppm(st));
    double f = vc_nvml_step(&cd->acc, old, (double)usage, charged, nprocs, (double)eff);
    if (f == old) return;
    __atomic_store_n(&st->nvml_factor_ppm, (uint32_t)(f * 1e6 + 0.5), __ATOMIC_RELAXED);
    vgpu_log(VGPU_LOG_DEBUG, "compute cap: device %d NVML share %d.%d%% vs charged %.1f%%: cost factor %.3f -> %.3f",
             dev, usage / 10, usage % 10, charged / 10.0, old, f);
}

static void *nvml_thread(void *arg) {
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* the application's signals are not for us */
    pthread_once(&nv_once, nv_resolve);
    if (!nv.ok) return NULL;
    for (;;) {
        vgpu_compute_sleep_until(vgpu_compute_now_ns() + NVML_PERIOD_NS / 4);
        for (int d = 0; d < VGPU_MAX_DEVICES; d++)
            if (__atomic_load_n(&g_nd[d].attached, __ATOMIC_ACQUIRE)) /* attached = capped (compute.c) */
                nvml_step(d);
    }
    return NULL;
}

int vgpu_compute_nvml_started(void) { return __atomic_load_n(&g_started, __ATOMIC_RELAXED); }

void vgpu_compute_nvml_start(void) {
    int no = 0;
    /* Marked started even if creation fails: no retry on every launch. The exchange makes one
     * thread the starter when several launch at once. */
    if (!__atomic_compare_exchange_n(&g_started, &no, 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return;
    pthread_attr_t a;
    pthread_t t;
    if (pthread_attr_init(&a)) {
        __atomic_store_n(&g_started, 0, __ATOMIC_RELAXED); /* try again at the next launch */
        return;
    }
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 256 * 1024);
    if (pthread_create(&t, &a, nvml_thread, NULL) != 0)
        vgpu_log(VGPU_LOG_INFO, "compute cap: no NVML helper thread; events only");
    pthread_attr_destroy(&a);
}

void vgpu_compute_nvml_atfork_child(void) {
    g_started = 0; /* threads do not survive fork: start it again when needed */
}

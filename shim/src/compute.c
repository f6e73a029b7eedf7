/*
 * Compute (SM) cap: per-device state, the launch gate and the completion measurements. The
 * settings are read by compute_config.c, the control law is in compute_controller.c, the demand
 * records in demand.c, the NVML outer loop in compute_nvml.c (compute_nvml.h), the clock in
 * compute_clock.h; the hooks that call the gate are in launch_hooks.c. Design and rationale:
 * docs/compute.md.
 *
 * Per launch on a capped device, vgpu_compute_before runs four phases:
 *   target:  which device the launch goes to, whether it is capped, whether it is captured;
 *   prepare: attach the device, the cap to apply now, the slice's demand record;
 *   estimate: read finished measurements (cuEventQuery, never blocking), look up the cost
 *            estimate of (function, grid), decide whether to measure this launch;
 *   admit:   reserve that much budget in the slice's shared virtual-time bucket
 *            (region->compute[dev], lock-free), sleep until the reservation is due (no lock
 *            held), then, if measured, record the start event and note whether it is already
 *            complete;
 *   launch:  the real driver call;
 *   after:   record the end event and queue the pair; when it completes, the device time of the
 *            kernel (the pair's elapsed time, less the host's own launch time when the device was
 *            idle before it) updates the estimate and the difference between it and what was
 *            charged is charged (or refunded) to the bucket: a feedback loop on measured time.
 *
 * Thread safety: one process-wide mutex (g_mu) guards the estimator and the event rings; it is
 * never held while sleeping, and only non-blocking driver calls are made under it. The common
 * case (gate_fast: a launch of the key the thread launched last, its estimate learned, not drawn
 * for measurement, nothing due in the ring) takes no lock: it charges a per-thread copy of the
 * estimate (gate_cache, thread-local), valid while the estimator's generation (g_est.gen, bumped
 * under g_mu whenever an estimate or an entry changes) is the one copied, and reads the ring's
 * drain_at hint atomically. The same cache keeps the device of the thread's current context
 * (gate_target), while no context has gone since (g_ctx_gen, bumped by the context hooks).
 * Fork safety: the child re-initialises the mutex and forgets the parent's events (a CUDA
 * context does not survive fork) and its thread's cached copy; the slice's shared state is, by
 * design, shared.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "compute.h"
#include "compute_clock.h"
#include "compute_config.h"
#include "compute_controller.h"
#include "compute_nvml.h"
#include "demand.h"
#include "compat.h"
#include "devices.h"
#include "log.h"
#include "region.h"
#include "symbols.h"

_Static_assert(sizeof(struct vgpu_compute_state) == 512, "compute state size is part of the region layout");

/* ------------------------------------------------------------ tunables (docs/compute.md) */
#ifndef BURST_NS
#define BURST_NS (20 * 1000000LL) /* how far a slice may run ahead of its schedule */
#endif
#define WANT_HOLD_NS         (100 * 1000000LL) /* a slice "wants" time this long after a launch */
#define NODE_CHECK_NS        (1000000LL)       /* elastic: re-read the neighbours' demand at most every 1 ms */
#define HEARTBEAT_NS         (5 * 1000000LL)   /* rewrite want_until when it moved by more than this */
#define UNKNOWN_WAIT_MAX_NS  (200 * 1000000LL) /* first launch of a key: wait this long at most */
#define INFLIGHT_MAX_NS      (8 * 1000000LL)   /* elastic, uncapped: device time queued ahead at most */
#define INFLIGHT_WAIT_MAX_NS (100 * 1000000LL)
#define POLL_NS              (1000000LL)     /* sleep between completion polls (never spin) */
#define MIN_SLEEP_NS         (2000000LL)     /* a launch due sooner than this goes now: batches wake-ups */
#define RING                 256             /* measured launches in flight per context */
#define RETRY_MIN_NS         (10 * 1000LL)   /* a due measurement found incomplete is read again after this, */
#define RETRY_MAX_NS         (1000 * 1000LL) /* doubling up to this (behind a neighbour's time slice) */
#define MAX_CTX              32
#define MEASURE_ALL_FIRST    32 /* measure every launch of a key until it has this many samples */
#ifndef MEASURE_EVERY           /* -D for profiling builds only (BENCHMARKS.md: the unmeasured launch's cost) */
#define MEASURE_EVERY 4         /* then one launch in this many, at random, */
#endif
#ifndef MEASURE_EVERY_MAX
#define MEASURE_EVERY_MAX 256 /* or fewer for short kernels: */
#endif
#ifndef MEASURE_SPACING_NS
#define MEASURE_SPACING_NS (400 * 1000LL) /* about one per this much estimated device time */
#endif
#define START_WAIT_NS (5 * 1000LL) /* a measured launch waits this long at most for its start event */

/* ------------------------------------------------------------ configuration (compute_config.c) */
static struct vgpu_compute_config g_cfg = {.policy = VGPU_COMPUTE_POLICY_HARD, .priority = 1, .nvml_loop = 1};
int vgpu_compute_on; /* = g_cfg.enabled, for launch_hooks.c (compute.h) */

/* ------------------------------------------------------------ driver entry points we call */
typedef CUresult (*pfn_ctx_get_current)(CUcontext *);
typedef CUresult (*pfn_ctx_get_device)(CUdevice *);
typedef CUresult (*pfn_event_create)(CUevent *, unsigned int);
typedef CUresult (*pfn_event_record)(CUevent, CUstream);
typedef CUresult (*pfn_event_destroy)(CUevent);
typedef CUresult (*pfn_event_query)(CUevent);
typedef CUresult (*pfn_event_elapsed)(float *, CUevent, CUevent);
typedef CUresult (*pfn_stream_is_capturing)(CUstream, CUstreamCaptureStatus *);
typedef CUresult (*pfn_device_get_uuid)(CUuuid *, CUdevice);
static struct {
    pfn_ctx_get_current ctx_get_current;
    pfn_ctx_get_device ctx_get_device;
    pfn_event_create event_create;
    pfn_event_record event_record;
    pfn_event_destroy event_destroy;
    pfn_event_query event_query;
    pfn_event_elapsed event_elapsed;
    pfn_stream_is_capturing stream_is_capturing;
    pfn_device_get_uuid device_get_uuid;
} drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static int drv_ok;
/* drv_resolve has run (launches then skip pthread_once, a call): DRV_GATE when the context
 * functions the gate needs are there, DRV_NONE when not. 0: not yet. */
enum { DRV_NONE = 1, DRV_GATE = 2 };
static int drv_state;

/* The driver's own functions, resolved as every other part of the shim resolves them
 * (vgpu_cuda_sym: dlsym on the driver's handle, so neither the shim's dlsym map nor another
 * interposer hands us a wrapper), by their exported ABI-versioned names, default (legacy-stream)
 * versions. */
static void drv_resolve(void) {
    drv.ctx_get_current = (pfn_ctx_get_current)vgpu_cuda_sym("cuCtxGetCurrent");
    drv.ctx_get_device = (pfn_ctx_get_device)vgpu_cuda_sym("cuCtxGetDevice");
    drv.event_create = (pfn_event_create)vgpu_cuda_sym("cuEventCreate");
    drv.event_record = (pfn_event_record)vgpu_cuda_sym("cuEventRecord");
    drv.event_destroy = (pfn_event_destroy)vgpu_cuda_sym("cuEventDestroy_v2");
    drv.event_query = (pfn_event_query)vgpu_cuda_sym("cuEventQuery");
    drv.event_elapsed = (pfn_event_elapsed)vgpu_cuda_sym("cuEventElapsedTime");
    drv.stream_is_capturing = (pfn_stream_is_capturing)vgpu_cuda_sym("cuStreamIsCapturing");
    drv.device_get_uuid = (pfn_device_get_uuid)vgpu_cuda_sym("cuDeviceGetUuid_v2");
    drv_ok = drv.ctx_get_current && drv.ctx_get_device && drv.event_create && drv.event_record && drv.event_query &&
             drv.event_elapsed;
    __atomic_store_n(&drv_state, drv.ctx_get_current && drv.ctx_get_device ? DRV_GATE : DRV_NONE, __ATOMIC_RELEASE);
    if (!drv_ok)
        vgpu_log(VGPU_LOG_ERROR, "compute cap: the driver lacks event functions; launches are charged "
                                 "by estimate only (no measurement)");
}

/* ------------------------------------------------------------ per-process state */
enum { SLOT_FREE = 0, SLOT_RESERVED = 1, SLOT_PENDING = 2, SLOT_SKIP = 3 };

struct ring_slot {
    CUevent start, end; /* created lazily in the context, reused */
    uintptr_t key;
    uint64_t grid;
    uint64_t charged;
    int64_t host_ns;  /* host time from the start event's known completion to the launch's return; 0 = unknown */
    int64_t due_ns;   /* not worth querying before this (host time of the end record + charged) */
    int64_t retry_ns; /* the wait before the next read when found incomplete (0: not yet read) */
    int state;
};

struct cctx {
    CUcontext ctx; /* NULL = unused; set once under g_mu, read atomically by the fast path */
    int dev;
    unsigned head, tail;    /* ring indices (mod RING); [head, tail) are reserved or pending */
    int64_t outstanding_ns; /* charged device time of pending slots */
    /* Before this host time drain_ctx has nothing to do (the ring is empty, or its oldest
     * measurement is not due yet): launches before it need not take g_mu to drain. Never later
     * than the true time (0: drain at the next launch). Written under g_mu, read atomically. */
    int64_t drain_at;
    struct ring_slot ring[RING];
};

struct cdev {
    int attached;
    struct vgpu_compute_state *st;
    struct vgpu_node_slot *own; /* this slice's demand record on the device (NULL: none) */
    int elastic;                /* own and the policy is elastic: effective_cap follows the neighbours */
    uint8_t uuid_bytes[16];
    uint64_t slice_id; /* this slice's id */
    int64_t next_node_check;
    int64_t published_want;
    uint32_t eff;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct vc_estimator g_est;
static struct cctx g_ctx[MAX_CTX];
static struct cdev g_dev[VGPU_MAX_DEVICES];
static struct vgpu_compute_state g_private[VGPU_MAX_DEVICES]; /* when no region is mapped */
static uint64_t g_draw; /* seeds the threads' draw states (gate_cache.draw); under g_mu, seeded at the first attach */

/* Per thread: the common case of the gate (a launch of the key this thread launched last, its
 * estimate learned, not drawn for measurement, the cap below 100%, nothing due in the context's
 * ring) needs neither g_mu nor the estimator: it charges the estimate copied here, which is the
 * table's while g_est.gen is unchanged (gate_fast). Filled under g_mu by gate_estimate. A
 * thread's own state: no lock. */
struct gate_cache {
    CUcontext ctx;
    struct cctx *cx; /* ctx's ring (its ctx field is checked: a fork child's rings are reset) */
    uintptr_t key;
    uint64_t grid;
    uint64_t est;      /* vc_est_cost of the entry (before the NVML loop's factor) */
    uint64_t gen;      /* g_est.gen when copied; 0 = empty (the table's starts at 0 and only grows) */
    uint64_t every;    /* measure_every(est) */
    uint32_t ppm;      /* the NVML loop's stored factor cost was computed with (vgpu_compute_cost_factor_ppm) */
    uint32_t step_eff; /* the cap step was computed for (0: none) */
    uint64_t cost;     /* est x factor, rounded: what a launch is charged while ppm is in force */
    int64_t step;      /* vc_wall_ns(cost, step_eff): the launch's wall time in the bucket */
    uint64_t draw;     /* this thread's splitmix64 state for measure_draw (0 = not seeded yet) */
    /* The device of dctx (gate_target), while g_ctx_gen is dgen: a context's device never
     * changes, but a context can go and a new one get its address. Kept only where the driver
     * shows one device (vgpu_device_only_one): a context destroyed out of the shim's sight (the
     * CUDA runtime's private table) can then only be followed by one on the same device. */
    CUcontext dctx;
    uint64_t dgen;
    CUdevice dcudev;
    int ddev;
};
/* initial-exec: the launch path reaches it with one %fs-relative access instead of a
 * __tls_get_addr call. The shim is loaded at start-up (LD_PRELOAD, /etc/ld.so.preload), so its
 * TLS is in the static TLS block; were it ever dlopen'ed, glibc serves initial-exec TLS of a
 * dlopen'ed library from its static TLS reserve (this ~90-byte struct is the shim's only
 * thread-local; the reserve is 512 bytes and up on every glibc the shim supports). */
static __thread struct gate_cache t_gc __attribute__((tls_model("initial-exec")));

/* Stream captures in progress in the process (vgpu_compute_captures, from the capture hooks),
 * plus CAPTURES_UNSEEN for good once a stream was found capturing while this said none
 * (capture_allows_events). While 0 no stream is captured, and the gate does not ask the driver
 * whether a launch's stream is (cuStreamIsCapturing: on the simulator the largest single part of
 * an unmeasured launch's cost). Never below 0: an end the hooks count that they did not see begin
 * cannot hide another capture for good. */
#define CAPTURES_UNSEEN (1 << 24)
static int g_captures;

void vgpu_compute_captures(int delta) {
    int cur = __atomic_load_n(&g_captures, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(&g_captures, &cur, cur + delta < 0 ? 0 : cur + delta, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED));
}

/* Whether the stream is capturing: 1, 0 (also where the driver has no cuStreamIsCapturing: it
 * predates capture), or -1 when the driver cannot say. The one question the gate and the capture
 * hooks ask. */
static int stream_capturing(CUstream stream) {
    if (!drv.stream_is_capturing) return 0;
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    if (drv.stream_is_capturing(stream, &cs) != CUDA_SUCCESS) return -1;
    return cs != CU_STREAM_CAPTURE_STATUS_NONE;
}

int vgpu_compute_stream_capturing(CUstream stream) {
    pthread_once(&drv_once, drv_resolve);
    return stream_capturing(stream);
}

/* Bumped (vgpu_compute_ctx_gone) after any context may have gone: the threads' cached devices of
 * their contexts (gate_cache.dctx) are then dropped. Starts at 1: dgen 0 is an empty cache. */
static uint64_t g_ctx_gen = 1;

CUresult vgpu_compute_ctx_gone(CUresult rc) {
    __atomic_fetch_add(&g_ctx_gen, 1, __ATOMIC_RELEASE);
    return rc;
}

/* The cost to charge for an estimate: est x the NVML loop's factor, rounded. */
static inline uint64_t charged_cost(uint64_t est, double factor) { return (uint64_t)((double)est * factor + 0.5); }

static void atfork_child(void) {
    pthread_mutex_init(&g_mu, NULL);
    vgpu_demand_atfork_child();
    /* The parent's contexts (and so its events) are not usable here. */
    memset(g_ctx, 0, sizeof g_ctx);
    t_gc = (struct gate_cache){0}; /* the one thread of the child: re-seeded, its rings gone */
    vgpu_compute_nvml_atfork_child();
    for (unsigned i = 0; i < VC_EST_SLOTS; i++) g_est.e[i].in_flight = 0;
}

int vgpu_compute_init(void) {
    if (vgpu_compute_config_load(&g_cfg)) return 1;
    vgpu_compute_on = g_cfg.enabled;
    if (g_cfg.enabled) {
        vgpu_require_region();
        pthread_atfork(NULL, NULL, atfork_child);
        vgpu_log(VGPU_LOG_INFO, "compute cap: policy %s, priority %d, node state %s",
                 g_cfg.policy == VGPU_COMPUTE_POLICY_ELASTIC ? "elastic" : "hard", (int)g_cfg.priority,
                 vgpu_demand_dir());
    }
    return 0;
}

uint32_t vgpu_compute_cap_permille(int dev) { return dev >= 0 && dev < VGPU_MAX_DEVICES ? g_cfg.cap[dev] : 0; }

/* ------------------------------------------------------------ attach a device */
static uint64_t random_id(void) {
    uint64_t x = (uint64_t)vgpu_compute_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&x;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x ? x : 1;
}

static __attribute__((noinline)) void attach_device(int dev, CUdevice cudev) {
    struct cdev *cd = &g_dev[dev];
    struct vgpu_region *r = vgpu_region();
    struct vgpu_compute_state *st = r ? &r->compute[dev] : &g_private[dev];
    if (!r) vgpu_log(VGPU_LOG_WARN, "compute cap: no accounting region; the cap of device %d is per process", dev);
    uint64_t zero = 0;
    uint64_t id = random_id();
    if (!__atomic_compare_exchange_n(&st->slice_id, &zero, id, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) id = zero;
    __atomic_store_n(&st->effective_permille, g_cfg.cap[dev], __ATOMIC_RELAXED);
    __atomic_store_n(&st->version, VGPU_COMPUTE_STATE_VERSION, __ATOMIC_RELEASE);
    __atomic_fetch_add(&st->attached, 1, __ATOMIC_RELAXED);
    cd->st = st;
    cd->eff = g_cfg.cap[dev];
    char uuid[48] = ""; /* "GPU-..." for NVML, "" when unknown */
    CUuuid u;
    if (drv.device_get_uuid && drv.device_get_uuid(&u, cudev) == CUDA_SUCCESS) {
        const unsigned char *b = (const unsigned char *)u.bytes;
        memcpy(cd->uuid_bytes, b, 16);
        snprintf(uuid, sizeof uuid, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
        cd->own = vgpu_demand_own(dev, cd->uuid_bytes, id, g_cfg.cap[dev], g_cfg.policy, g_cfg.priority);
    }
    cd->slice_id = id;
    if (!g_draw) g_draw = random_id();
    cd->elastic = g_cfg.policy == VGPU_COMPUTE_POLICY_ELASTIC && cd->own;
    if (g_cfg.policy == VGPU_COMPUTE_POLICY_ELASTIC && !cd->own)
        vgpu_log(VGPU_LOG_WARN, "compute cap: elastic policy without node state (%s): device %d keeps its cap",
                 vgpu_demand_dir(), dev);
    vgpu_compute_nvml_attach(dev, uuid, st);
    __atomic_store_n(&cd->attached, 1, __ATOMIC_RELEASE);
}

/* ------------------------------------------------------------ contexts and measurements */
static struct cctx *ctx_get(CUcontext ctx, int dev) {
    struct cctx *free_slot = NULL;
    for (int i = 0; i < MAX_CTX; i++) {
        if (g_ctx[i].ctx == ctx) {
            g_ctx[i].dev = dev;
            return &g_ctx[i];
        }
        if (!g_ctx[i].ctx && !free_slot) free_slot = &g_ctx[i];
    }
    if (!free_slot) return NULL; /* more than MAX_CTX contexts: launches there are charged by estimate only */
    memset(free_slot, 0, sizeof *free_slot);
    free_slot->dev = dev;
    __atomic_store_n(&free_slot->ctx, ctx, __ATOMIC_RELEASE);
    return free_slot;
}

/* The device time a measured launch took: the elapsed time of its event pair, less the host's own
 * launch time when the start event was complete before the launch call. Then the device sat idle
 * from the start event until the driver queued the kernel at the end of the call (the doorbell is
 * the last thing a launch does), and the pair spans that host time, not device work: for kernels
 * shorter than a launch it would be most of the sample. When the start event was not yet complete
 * the kernel was queued behind other work and starts right after it: the pair is all device time. */
static uint64_t device_time(uint64_t sample, int64_t host_ns) {
    if (host_ns <= 0) return sample;
    return sample > (uint64_t)host_ns ? sample - (uint64_t)host_ns : 0;
}

/* The host time of a launch call to subtract (device_time): this call's, but no more than the
 * usual (a running mean of the calls, each counted as at most twice the mean). A thread
 * preempted after the doorbell and before the return would otherwise have the preemption taken
 * off its kernel's time; a call slower than usual before its doorbell is charged the rest (too
 * much, never too little). Under g_mu. */
static int64_t g_call_ns;

static int64_t launch_call_ns(int64_t call) {
    if (call < 0) call = 0;
    if (!g_call_ns) {
        g_call_ns = call ? call : 1;
        return call;
    }
    int64_t usual = g_call_ns;
    g_call_ns += ((call < 2 * usual ? call : 2 * usual) - usual) / 32;
    if (g_call_ns < 1) g_call_ns = 1;
    return call < usual ? call : usual;
}

/* Read finished measurements of one context, oldest first. Under g_mu; non-blocking calls only. */
static void drain_ctx(struct cctx *cx, int64_t now, int budget) {
    if (!drv_ok) return;
    struct cdev *cd = &g_dev[cx->dev];
    while (cx->head != cx->tail && budget-- > 0) {
        struct ring_slot *s = &cx->ring[cx->head % RING];
        if (s->state == SLOT_SKIP) { /* a launch that could not be measured */
            s->state = SLOT_FREE;
            cx->head++;
            continue;
        }
        if (s->state != SLOT_PENDING || now < s->due_ns)
            break; /* reserved by a launch still in progress, or cannot be done yet */
        /* cuEventElapsedTime answers NOT_READY while either event is incomplete (the start
         * precedes the end in the stream): one driver call reads completion and time. */
        float ms = 0;
        CUresult q = drv.event_elapsed(&ms, s->start, s->end);
        if (q == CUDA_ERROR_NOT_READY) {
            /* Queued behind other work (a neighbour's time slice, a long kernel): read it again
             * later, backing off, so that the launches meanwhile keep the lock-free path instead
             * of each asking the driver. */
            int64_t wait = s->retry_ns ? 2 * s->retry_ns : RETRY_MIN_NS;
            s->retry_ns = wait < RETRY_MAX_NS ? wait : RETRY_MAX_NS;
            s->due_ns = now + s->retry_ns;
            break;
        }
        struct vc_est_entry *e = vc_est_lookup(&g_est, s->key, s->grid);
        if (e->in_flight) e->in_flight--;
        if (q == CUDA_SUCCESS && ms >= 0 && cd->st) {
            uint64_t sample = device_time((uint64_t)llroundf(ms * 1e6f), s->host_ns);
            int accepted;
            uint64_t est = vc_est_update(e, sample, &accepted);
            __atomic_store_n(&g_est.gen, g_est.gen + 1, __ATOMIC_RELEASE); /* copies in gate_cache are stale */
            /* A measured launch pays what it took (run-to-run variation and rare slow runs are
             * then charged as they happen); one that waited for other work pays the estimate. */
            uint64_t cost = accepted ? sample : est;
            int64_t delta = (int64_t)charged_cost(cost, vgpu_compute_cost_factor(cd->st)) - (int64_t)s->charged;
            uint32_t pm = __atomic_load_n(&cd->eff, __ATOMIC_RELAXED);
            if (!pm) pm = g_cfg.cap[cx->dev];
            if (pm && pm < VC_PERMILLE_FULL) vc_correct(&cd->st->tat_ns, now, delta, pm);
            __atomic_fetch_add(&cd->st->charged_ns, delta, __ATOMIC_RELAXED);
            __atomic_fetch_add(&cd->st->measured_ns, sample, __ATOMIC_RELAXED);
            __atomic_fetch_add(&cd->st->measured_launches, 1, __ATOMIC_RELAXED);
        }
        /* On an error (context destroyed, event invalid) the measurement is lost, nothing else. */
        cx->outstanding_ns -= (int64_t)s->charged;
        s->state = SLOT_FREE;
        cx->head++;
    }
    /* When there is something to do next: nothing pending, or the oldest measurement's due
     * time (pushed back when it was found incomplete); now again when it is reserved by a launch
     * in progress (its after() lowers the hint when it queues the pair) or the budget ran out. */
    int64_t at = 0;
    if (cx->head == cx->tail)
        at = INT64_MAX;
    else {
        const struct ring_slot *h = &cx->ring[cx->head % RING];
        if (h->state == SLOT_PENDING && now < h->due_ns) at = h->due_ns;
    }
    __atomic_store_n(&cx->drain_at, at, __ATOMIC_RELAXED);
}

/* A slot of cx was queued (due at `due`) or skipped (0): drain no later than that. Under g_mu. */
static void drain_hint_lower(struct cctx *cx, int64_t due) {
    if (due < __atomic_load_n(&cx->drain_at, __ATOMIC_RELAXED)) __atomic_store_n(&cx->drain_at, due, __ATOMIC_RELAXED);
}

/* Threads of the process call these concurrently without g_mu: the per-process fields they
 * touch (published_want, next_node_check, eff) are only read and written atomically, and a
 * lost update just repeats a cheap step. */
static __attribute__((noinline)) void publish_want_now(struct cdev *cd, int64_t until) {
    struct vgpu_node_slot *s = cd->own;
    int64_t cur = __atomic_load_n(&s->want_until_ns, __ATOMIC_RELAXED);
    /* Processes of a slice race here; only ever move it forward. */
    while (cur < until &&
           !__atomic_compare_exchange_n(&s->want_until_ns, &cur, until, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED));
    __atomic_store_n(&cd->published_want, until, __ATOMIC_RELAXED);
}

/* The shared record is written only when the time moved by HEARTBEAT_NS (or went back): the
 * test is inline, being on every launch's path. */
static inline void publish_want(struct cdev *cd, int64_t until) {
    if (!cd->own) return;
    int64_t pub = __atomic_load_n(&cd->published_want, __ATOMIC_RELAXED);
    if (until - pub < HEARTBEAT_NS) return; /* (until went back: also < HEARTBEAT_NS) */
    publish_want_now(cd, until);
}

/* Elastic: recompute the cap from the neighbours' demand (their records, read as copies). */
static __attribute__((noinline)) void node_check(struct cdev *cd, int dev, int64_t now) {
    struct vgpu_node_slot view[1 + 64];
    int n = vgpu_demand_peers(cd->uuid_bytes, now, view + 1, 64);
    if (n < 0) return;  /* nothing to read now: keep the last decision */
    view[0] = *cd->own; /* a snapshot: only its settings matter, and they are this process's */
    view[0].cap_permille = g_cfg.cap[dev] ? g_cfg.cap[dev] : VC_PERMILLE_FULL;
    view[0].policy = g_cfg.policy;
    view[0].priority = g_cfg.priority;
    view[0].want_until_ns = now + 1;
    view[0].slice_id = 1;
    for (int i = 1; i <= n; i++) view[i].slice_id = (uint64_t)i + 1; /* distinct from mine whatever the files say */
    uint32_t e = vc_elastic_permille(view, (size_t)n + 1, 0, now);
    if (e < g_cfg.cap[dev]) e = g_cfg.cap[dev];
    uint32_t old = __atomic_exchange_n(&cd->eff, e, __ATOMIC_RELAXED);
    if (e != old) {
        /* Going back to (or towards) the cap: start from now, with neither the debt nor the
         * credit of the uncapped period, and without the burst allowance (tat = now + burst):
         * the newcomer gets its share from the first millisecond. */
        if (e < old) vc_reset(&cd->st->tat_ns, now + BURST_NS);
        __atomic_store_n(&cd->st->effective_permille, e, __ATOMIC_RELAXED);
    }
}

/* The cap to apply now on this device (permille, VC_PERMILLE_FULL = none). An elastic slice runs
 * node_check once per NODE_CHECK_NS (the thread of the process that wins the CAS). */
static uint32_t effective_cap(struct cdev *cd, int dev, int64_t now) {
    if (!cd->elastic) return g_cfg.cap[dev];
    int64_t due = __atomic_load_n(&cd->next_node_check, __ATOMIC_RELAXED);
    if (now >= due && __atomic_compare_exchange_n(&cd->next_node_check, &due, now + NODE_CHECK_NS, 0, __ATOMIC_RELAXED,
                                                  __ATOMIC_RELAXED))
        node_check(cd, dev, now);
    return __atomic_load_n(&cd->eff, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------ the gate */
/* Phase "target": the launch's context and app-visible device, and whether it is charged at all
 * (0: the device is not capped, the context cannot be told, so the driver will fail the launch,
 * or the stream is capturing: recorded into a graph, not run, cuGraphLaunch pays for it).
 * *may_measure = 0 when asking about the capture failed (e.g. another thread captures in global
 * mode): our own event records could disturb that capture, so the launch is charged, not measured. */
static int gate_target(CUstream stream, CUcontext *ctx, CUdevice *cudev, int *dev, int *may_measure) {
    if (__atomic_load_n(&drv_state, __ATOMIC_ACQUIRE) != DRV_GATE) {
        pthread_once(&drv_once, drv_resolve);
        if (__atomic_load_n(&drv_state, __ATOMIC_ACQUIRE) != DRV_GATE) return 0;
    }
    if (drv.ctx_get_current(ctx) != CUDA_SUCCESS || !*ctx) return 0;
    struct gate_cache *gc = &t_gc;
    /* Read before asking the driver: a context gone after this read bumps it past, and the
     * device found for it is then not used again. */
    uint64_t gen = __atomic_load_n(&g_ctx_gen, __ATOMIC_ACQUIRE);
    if (gc->dctx == *ctx && gc->dgen == gen) {
        if (gc->ddev < 0) return 0; /* not capped */
        *cudev = gc->dcudev;
        *dev = gc->ddev;
    } else {
        if (drv.ctx_get_device(cudev) != CUDA_SUCCESS) return 0;
        *dev = vgpu_device_index(*cudev);
        if (*dev < 0 || *dev >= VGPU_MAX_DEVICES || !g_cfg.cap[*dev]) *dev = -1;
        if (vgpu_device_only_one()) {
            gc->dctx = *ctx;
            gc->dgen = gen;
            gc->dcudev = *cudev;
            gc->ddev = *dev;
        }
        if (*dev < 0) return 0;
    }
    *may_measure = 1;
    if (stream == NULL || stream == CU_STREAM_LEGACY || !__atomic_load_n(&g_captures, __ATOMIC_ACQUIRE)) {
        /* The legacy default stream cannot be captured (CUDA refuses to begin a capture on it),
         * and no stream is while the process has no capture in progress (g_captures), so the
         * launch is charged without asking. Our events could still disturb a capture (another
         * thread's in global mode, one begun out of the hooks' sight): asked only before
         * measuring (capture_allows_events). */
        *may_measure = 2;
        return 1;
    }
    int capturing = stream_capturing(stream);
    if (capturing == 1) return 0;
    if (capturing < 0) *may_measure = 0;
    return 1;
}

/* A launch charged without asking about capture (may_measure 2, gate_target) about to be
 * measured: whether recording our events on its stream is allowed (no capture forbids it). A
 * stream found capturing while g_captures says none was begun where no hook saw it (an entry
 * point the shim does not know): from then on every launch asks (gate_target). */
static int capture_allows_events(CUstream stream) {
    int capturing = stream_capturing(stream);
    if (capturing == 1 && !__atomic_load_n(&g_captures, __ATOMIC_ACQUIRE) &&
        __atomic_fetch_add(&g_captures, CAPTURES_UNSEEN, __ATOMIC_ACQ_REL) == 0)
        vgpu_log(VGPU_LOG_WARN,
                 "compute cap: a stream is capturing though no capture was seen to begin (an entry "
                 "point the shim does not hook); from now on every launch asks the driver about capture");
    return capturing == 0;
}

/* Phase "prepare": the device attached (once per process), the NVML loop running (started at the
 * first capped launch, and again in a fork child of a process that had it), the cap to apply
 * now, the slice's demand moved forward. */
static struct cdev *gate_prepare(int dev, CUdevice cudev, int64_t now, uint32_t *eff) {
    struct cdev *cd = &g_dev[dev];
    if (!__atomic_load_n(&cd->attached, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&g_mu);
        if (!cd->attached) attach_device(dev, cudev);
        pthread_mutex_unlock(&g_mu);
    }
    *eff = effective_cap(cd, dev, now);
    publish_want(cd, now + WANT_HOLD_NS);
    return cd;
}

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Whether to measure this launch of a key that has its first samples (estimate est): one in n at
 * random, n such that the key is measured about once per MEASURE_SPACING_NS of its device time
 * (within MEASURE_EVERY .. MEASURE_EVERY_MAX), so that the events cost short kernels little. At
 * random, so that a program cannot tell which of its launches are measured and make only those
 * short. The calling thread's draw state (gate_cache.draw, seeded by gate_estimate). */
static uint64_t measure_every(uint64_t est) {
    uint64_t n = est ? (uint64_t)MEASURE_SPACING_NS / est : MEASURE_EVERY_MAX;
    if (n < MEASURE_EVERY) n = MEASURE_EVERY;
    if (n > MEASURE_EVERY_MAX) n = MEASURE_EVERY_MAX;
    return n;
}

static inline int measure_draw(struct gate_cache *c, uint64_t n) {
    /* uniform in [0, n) by a multiply (no division on the launch path) */
    return (uint64_t)(((unsigned __int128)splitmix64(&c->draw) * n) >> 64) == 0;
}

/* Phase "estimate": the cost to charge (L->cost) and whether to measure (returned), learning
 * before guessing twice: a key never measured has one launch in flight, and an elastic slice
 * running uncapped keeps at most INFLIGHT_MAX_NS of estimated work queued. Meanwhile it
 * sleep-polls, holding nothing, and follows the cap (L->eff) as it changes. */
static __attribute__((noinline)) int gate_estimate(struct vgpu_launch *L, struct cdev *cd, struct gate_cache *gc,
                                                   CUcontext ctx, int may_measure, int drawn) {
    int64_t deadline = L->now + UNKNOWN_WAIT_MAX_NS;
    /* Here, not on every launch: a process's first capped launch, and a fork child's, come
     * through this path (the child's thread cache is reset). */
    if (g_cfg.nvml_loop && !vgpu_compute_nvml_started()) vgpu_compute_nvml_start();
    for (;;) {
        pthread_mutex_lock(&g_mu);
        if (!gc->draw) gc->draw = splitmix64(&g_draw) | 1; /* a stream of its own per thread */
        struct cctx *cx = ctx_get(ctx, L->dev);
        if (cx) drain_ctx(cx, L->now, 64);
        struct vc_est_entry *e = vc_est_lookup(&g_est, L->key, L->grid);
        int unknown_busy = e->samples == 0 && e->in_flight > 0 && drv_ok;
        int queue_full = L->eff >= VC_PERMILLE_FULL && cx && cx->outstanding_ns > INFLIGHT_MAX_NS;
        if ((!unknown_busy && !queue_full) || L->now >= deadline) {
            L->cx = cx;
            uint64_t est = vc_est_cost(e);
            uint32_t ppm = vgpu_compute_cost_factor_ppm(cd->st);
            L->cost = charged_cost(est, vgpu_compute_cost_factor_of(ppm));
            L->step = vc_wall_ns((int64_t)L->cost, L->eff);
            /* Every launch while learning a key and while running uncapped (the queue bound needs
             * them), then a sample (drawn by gate_fast already, or now). */
            int measure = drv_ok && may_measure && cx && cx->tail - cx->head < RING &&
                          (e->samples < MEASURE_ALL_FIRST || L->eff >= VC_PERMILLE_FULL || drawn ||
                           measure_draw(gc, measure_every(est))) &&
                          (may_measure != 2 || capture_allows_events(L->stream));
            if (measure) e->in_flight++;
            if (cx && e->samples >= MEASURE_ALL_FIRST)
                *gc = (struct gate_cache){.ctx = ctx,
                                          .cx = cx,
                                          .key = L->key,
                                          .grid = L->grid,
                                          .est = est,
                                          .gen = __atomic_load_n(&g_est.gen, __ATOMIC_RELAXED),
                                          .every = measure_every(est),
                                          .ppm = ppm,
                                          .step_eff = L->eff,
                                          .cost = L->cost,
                                          .step = L->step,
                                          .draw = gc->draw,
                                          .dctx = gc->dctx,
                                          .dgen = gc->dgen,
                                          .dcudev = gc->dcudev,
                                          .ddev = gc->ddev};
            pthread_mutex_unlock(&g_mu);
            return measure;
        }
        pthread_mutex_unlock(&g_mu);
        if (queue_full && !unknown_busy && deadline > L->now + INFLIGHT_WAIT_MAX_NS)
            deadline = L->now + INFLIGHT_WAIT_MAX_NS;
        vgpu_compute_sleep_until(L->now + POLL_NS);
        L->now = vgpu_compute_now_ns();
        L->eff = effective_cap(cd, L->dev, L->now);
    }
}

/* The common case of phase "estimate", without g_mu: 1 when the launch is charged the cached
 * estimate (L->cost) and not measured. 0 sends it to gate_estimate: a key other than the thread's
 * last or whose estimate changed since, one still learning, an uncapped slice (it measures every
 * launch), a measurement due in the context's ring (read it first), or this launch drawn for
 * measurement (*drawn = 1: gate_estimate measures it if it can, without drawing again). The
 * entry's last use (eviction order) is not moved here: its key's measured launches keep it recent. */
static int gate_fast(struct vgpu_launch *L, struct cdev *cd, struct gate_cache *c, CUcontext ctx, int *drawn) {
    *drawn = 0;
    if (L->eff >= VC_PERMILLE_FULL || !c->gen || c->ctx != ctx || c->key != L->key || c->grid != L->grid) return 0;
    if (c->gen != __atomic_load_n(&g_est.gen, __ATOMIC_ACQUIRE)) return 0;
    if (__atomic_load_n(&c->cx->ctx, __ATOMIC_ACQUIRE) != ctx) return 0;
    if (L->now >= __atomic_load_n(&c->cx->drain_at, __ATOMIC_RELAXED)) return 0;
    if (measure_draw(c, c->every)) {
        *drawn = 1;
        return 0;
    }
    L->cx = c->cx;
    uint32_t ppm = vgpu_compute_cost_factor_ppm(cd->st);
    if (ppm != c->ppm) {
        c->ppm = ppm;
        c->cost = charged_cost(c->est, vgpu_compute_cost_factor_of(ppm));
        c->step_eff = 0;
    }
    if (L->eff != c->step_eff) {
        c->step_eff = L->eff;
        c->step = vc_wall_ns((int64_t)c->cost, L->eff);
    }
    L->cost = c->cost;
    L->step = c->step;
    return 1;
}

/* Phase "admit": reserve the cost in the slice's bucket and sleep until it is due, holding
 * nothing (the reservation is already ours). A launch due within MIN_SLEEP_NS goes at once: a
 * thread of many tiny kernels then sleeps once per ~2 ms of budget instead of once per kernel
 * (CPU), at the price of running up to 2 ms further ahead of its schedule; the long-run rate is
 * the bucket's either way. Returns 1 when it slept. */
static int gate_admit(struct vgpu_launch *L, struct cdev *cd) {
    if (L->eff >= VC_PERMILLE_FULL) return 0;
    int64_t go = vc_reserve_step(&cd->st->tat_ns, L->now, L->step, BURST_NS);
    if (go <= L->now + MIN_SLEEP_NS) return 0;
    publish_want(cd, go + WANT_HOLD_NS);
    vgpu_compute_sleep_until(go);
    __atomic_fetch_add(&cd->st->throttled, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&cd->st->wait_ns, (uint64_t)(go - L->now), __ATOMIC_RELAXED);
    L->now = vgpu_compute_now_ns();
    return 1;
}

/* Phase "measure": a ring slot (taken after the sleep, so that a sleeping thread does not hold
 * back the reading of everyone's completions, the ring being read in order; none when the ring
 * is full: then the launch is charged by estimate only), the start event recorded on the
 * launch's stream and, for a kernel, whether that event is already complete (device_time). */
static __attribute__((noinline)) void gate_measure(struct vgpu_launch *L, int slept) {
    struct cctx *cx = L->cx;
    L->measure_failed = 0;
    L->start_done = 0;
    pthread_mutex_lock(&g_mu);
    if (slept) drain_ctx(cx, L->now, 64);
    if (cx->tail - cx->head < RING) {
        L->slot = (int)(cx->tail % RING);
        cx->ring[L->slot].state = SLOT_RESERVED;
        cx->tail++;
    } else {
        struct vc_est_entry *e = vc_est_lookup(&g_est, L->key, L->grid);
        if (e->in_flight) e->in_flight--;
    }
    pthread_mutex_unlock(&g_mu);
    if (L->slot < 0) return;
    struct ring_slot *s = &cx->ring[L->slot];
    /* Only this thread touches a RESERVED slot. Events live in the context: create them here,
     * where that context is current. */
    if (!s->start && drv.event_create(&s->start, CU_EVENT_DEFAULT) != CUDA_SUCCESS) s->start = NULL;
    if (!s->end && drv.event_create(&s->end, CU_EVENT_DEFAULT) != CUDA_SUCCESS) s->end = NULL;
    int recorded = s->start && s->end && drv.event_record(s->start, L->stream) == CUDA_SUCCESS;
    int64_t recorded_at = vgpu_compute_now_ns();
    if (!recorded) {
        L->measure_failed = 1;
        /* Maybe events of a destroyed context (whose address a new context now has): replace
         * them next time. Destroying a dead context's event just fails. */
        if (drv.event_destroy) {
            if (s->start) drv.event_destroy(s->start);
            if (s->end) drv.event_destroy(s->end);
        }
        s->start = s->end = NULL;
        return;
    }
    /* When the start event is complete before the launch call, the host time from then to the
     * call's return is not the kernel's (device_time). Found complete by the very next call, it
     * completed when recorded; behind a short kernel still running (launch-bound work: the
     * previous launch's kernel), wait for it a little, polling, and take the time after the
     * query that saw it complete (it was complete by then). Not for graphs: a graph's launch call
     * may run some of its work before it returns, so its pair is charged whole. */
    if (!L->grid) return;
    CUresult q = drv.event_query(s->start);
    int64_t t = recorded_at;
    /* The kernel ahead, when it is this key's (a launch-bound loop), ends within about its
     * estimate: no longer (behind a neighbour's time slice or a long kernel it would wait in
     * vain, and the pair is then charged whole: the charge errs high, never low). */
    int64_t wait = (int64_t)L->cost + 1000 < START_WAIT_NS ? (int64_t)L->cost + 1000 : START_WAIT_NS;
    /* The event completed between the instants the last two queries looked, somewhere inside
     * each call: the middle of the query that saw it complete stands for that instant. Its end
     * would charge each polled pair about a whole poll round too much (a query and a clock
     * read: 4% of a 2 us kernel on the simulator, which a 50% cap turned into 48%). */
    while (q == CUDA_ERROR_NOT_READY && (t = vgpu_compute_now_ns()) - recorded_at < wait) {
        q = drv.event_query(s->start);
        if (q == CUDA_SUCCESS) t += (vgpu_compute_now_ns() - t) / 2;
    }
    if (q == CUDA_SUCCESS) L->start_done = t;
}

void vgpu_compute_before(struct vgpu_launch *L, uintptr_t key, uint64_t grid, CUstream stream) {
    L->active = 0;
    if (!g_cfg.enabled) return;
    CUcontext ctx = NULL;
    CUdevice cudev = 0;
    int dev = -1, may_measure = 0;
    if (!gate_target(stream, &ctx, &cudev, &dev, &may_measure)) return;
    L->dev = dev;
    L->key = key;
    L->grid = grid;
    L->stream = stream;
    L->cx = NULL;
    L->slot = -1;
    L->now = vgpu_compute_now_ns();
    struct cdev *cd = gate_prepare(dev, cudev, L->now, &L->eff);
    L->st = cd->st;
    struct gate_cache *gc = &t_gc;
    int drawn, measure = gate_fast(L, cd, gc, ctx, &drawn) ? 0 : gate_estimate(L, cd, gc, ctx, may_measure, drawn);
    int slept = gate_admit(L, cd);
    if (measure) gate_measure(L, slept);
    L->active = 1;
}

/* vgpu_compute_after of a measured launch: the end event and the pair queued. */
static __attribute__((noinline)) void after_measured(struct vgpu_launch *L, CUresult launched) {
    /* First the launch's return: the host time the pair spans before the kernel could start. */
    int64_t ret = vgpu_compute_now_ns();
    int measured = launched == CUDA_SUCCESS && !L->measure_failed &&
                   drv.event_record(L->cx->ring[L->slot].end, L->stream) == CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    struct ring_slot *s = &L->cx->ring[L->slot];
    if (measured) {
        s->key = L->key;
        s->grid = L->grid;
        s->charged = L->cost;
        s->host_ns = L->start_done ? launch_call_ns(ret - L->start_done) : 0;
        s->due_ns = ret + (int64_t)L->cost;
        s->retry_ns = 0;
        L->cx->outstanding_ns += (int64_t)L->cost;
        s->state = SLOT_PENDING;
        drain_hint_lower(L->cx, s->due_ns);
    } else {
        s->state = SLOT_SKIP; /* not measurable (launch or event record failed) */
        drain_hint_lower(L->cx, 0);
        struct vc_est_entry *e = vc_est_lookup(&g_est, L->key, L->grid);
        if (e->in_flight) e->in_flight--;
    }
    pthread_mutex_unlock(&g_mu);
}

/* The counters of a launch that ran. */
static inline void after_count(const struct vgpu_launch *L) {
    struct vgpu_compute_state *st = L->st;
    __atomic_fetch_add(&st->launches, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&st->charged_ns, (int64_t)L->cost, __ATOMIC_RELAXED);
    __atomic_store_n(&st->last_launch_ns, (uint64_t)L->now, __ATOMIC_RELAXED);
}

/* vgpu_compute_after of a measured launch or of one the driver refused (nothing ran: the budget
 * goes back). */
static __attribute__((noinline)) void after_rare(struct vgpu_launch *L, CUresult launched) {
    if (L->slot >= 0) after_measured(L, launched);
    if (launched != CUDA_SUCCESS) {
        if (L->eff < VC_PERMILLE_FULL) vc_correct(&L->st->tat_ns, vgpu_compute_now_ns(), -(int64_t)L->cost, L->eff);
        return;
    }
    after_count(L);
}

/* The common case (not measured, launched) is the three counters; the rest is out of line so
 * that it costs the common case no register saves. */
void vgpu_compute_after(struct vgpu_launch *L, CUresult launched) {
    if (!L->active) return;
    if (L->slot >= 0 || launched != CUDA_SUCCESS) {
        after_rare(L, launched);
        return;
    }
    after_count(L);
}

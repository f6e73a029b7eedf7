/*
 * Streams, host synchronisation and events on the simulated device.
 *
 * A launch (launch.c) queues its device time on this process's lane of the device (sched.c):
 * all work of the process on that device, FIFO, time-sliced against other processes' lanes.
 * Every stream keeps `tail`, the lane position at which the last work queued into it (or that
 * it waits for) is done; synchronisation sleeps until the scheduler's predicted completion and
 * checks again (a neighbour's launch may have taken slices meanwhile), queries compare positions.
 * The legacy NULL stream also waits for the blocking streams of its context (and they for it),
 * as in CUDA; CU_STREAM_NON_BLOCKING streams do not (their sync target is their own work).
 *
 * Pacing: a real pushbuffer fills, so a host thread cannot run arbitrarily far ahead of the
 * device. A launch blocks while the stream already has more than SIMGPU_QUEUE_AHEAD_US (default
 * 20 ms) of work queued, or SIM_PACE (1024) launches still unfinished. A launch loop is therefore
 * paced by the device, and the launch path itself makes no system call unless it has to wait
 * (an uncontended lock of the device's scheduler is a compare-and-swap).
 *
 * Events record the lane position of their stream's queued work; the time it completed comes
 * from the lane's service history, and cuEventElapsedTime reports the difference of those times.
 */
#include "stream.h"

#include "ctxstack.h"
#include "duration.h"
#include "init.h"

#include "../common/sched.h"
#include "../common/state.h"
#include "../common/util.h"

#include <stdlib.h>
#include <string.h>

static pthread_mutex_t free_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t ev_mu = PTHREAD_MUTEX_INITIALIZER;
static struct CUstream_st *stream_free;

struct CUstream_st *sim_stream_new(struct CUctx_st *ctx, int kind, unsigned flags, int priority) {
    pthread_mutex_lock(&free_mu);
    struct CUstream_st *s = stream_free;
    if (s) stream_free = s->next_free;
    pthread_mutex_unlock(&free_mu);
    if (!s) {
        s = malloc(sizeof *s);
        if (!s) return NULL;
    }
    /* Structures are recycled, never freed: a stale handle fails the magic check. */
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    s->ctx = ctx;
    s->ctx_serial = ctx->serial;
    s->kind = kind;
    s->flags = flags;
    s->priority = priority;
    /* The lane's position now (nothing older is this stream's), and the first-use costs of the
     * duration generator and of the lane's shared pages paid here rather than in a launch. */
    s->served_hint = sim_sched_served(sim_phys(ctx->dev), G.slot);
    (void)sim_kernel_sample_ns(0);
    s->gen = sim_gen();
    s->magic = MAGIC_STREAM;
    return s;
}

void sim_stream_release(struct CUstream_st *s) {
    s->magic = MAGIC_DEAD;
    pthread_mutex_lock(&free_mu);
    s->next_free = stream_free;
    stream_free = s;
    pthread_mutex_unlock(&free_mu);
}

/* The per-thread default stream of a context, per calling thread. */
#define PTDS_CACHE 8
static __thread struct {
    struct CUctx_st *ctx;
    uint64_t serial;
    struct CUstream_st *s;
} ptds_cache[PTDS_CACHE];
static __thread unsigned ptds_next;

static pthread_key_t ptds_key;
static pthread_once_t ptds_once = PTHREAD_ONCE_INIT;

/* Thread exit: its per-thread default streams go back to the free list. */
static void ptds_release_all(void *unused) {
    (void)unused;
    for (int i = 0; i < PTDS_CACHE; i++) {
        if (SIM_VALID(ptds_cache[i].s, MAGIC_STREAM) && ptds_cache[i].s->kind == STREAM_PER_THREAD)
            sim_stream_release(ptds_cache[i].s);
        ptds_cache[i].s = NULL;
        ptds_cache[i].ctx = NULL;
    }
}

static void ptds_key_init(void) { pthread_key_create(&ptds_key, ptds_release_all); }

static struct CUstream_st *per_thread_stream(struct CUctx_st *ctx) {
    for (int i = 0; i < PTDS_CACHE; i++)
        if (ptds_cache[i].ctx == ctx && ptds_cache[i].serial == ctx->serial && SIM_VALID(ptds_cache[i].s, MAGIC_STREAM))
            return ptds_cache[i].s;
    struct CUstream_st *s = sim_stream_new(ctx, STREAM_PER_THREAD, 0, 0);
    if (!s) return NULL;
    pthread_once(&ptds_once, ptds_key_init);
    pthread_setspecific(ptds_key, &ptds_cache); /* any non-NULL value arms the destructor */
    unsigned i = ptds_next++ % PTDS_CACHE;
    if (SIM_VALID(ptds_cache[i].s, MAGIC_STREAM) && ptds_cache[i].s->kind == STREAM_PER_THREAD)
        sim_stream_release(ptds_cache[i].s); /* evicted: this thread's stream of another context */
    ptds_cache[i].ctx = ctx;
    ptds_cache[i].serial = ctx->serial;
    ptds_cache[i].s = s;
    return s;
}

CUresult sim_resolve_stream(CUstream h, int ptds, struct CUstream_st **out) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct CUctx_st *c;
        rc = sim_get_ctx(&c);
        if (rc != CUDA_SUCCESS) return rc;
        int per_thread = h == CU_STREAM_PER_THREAD || (h == NULL && ptds);
        struct CUstream_st *s = per_thread ? per_thread_stream(c) : c->legacy;
        if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
        *out = s;
        return CUDA_SUCCESS;
    }
    if (!SIM_OWNED_VALID(h, MAGIC_STREAM)) return CUDA_ERROR_INVALID_HANDLE;
    *out = h;
    return CUDA_SUCCESS;
}

static int is_blocking(const struct CUstream_st *s) {
    return s->kind != STREAM_USER || !(s->flags & CU_STREAM_NON_BLOCKING);
}

void sim_lane_wait(struct CUctx_st *ctx, uint64_t pos) { sim_sched_wait(sim_phys(ctx->dev), G.slot, pos); }

/* A wait on another device's event (its lane is not this stream's): later work of the stream
 * waits for it on the host, once (the real driver would not block the caller: a simplification). */
static void wait_foreign_dep(struct CUstream_st *s) {
    if (s->dep_pos) {
        sim_sched_wait(s->dep_dev, G.slot, s->dep_pos);
        s->dep_pos = 0;
    }
}

void sim_stream_enqueue(struct CUstream_st *s, uint64_t dur_ns) {
    struct CUctx_st *ctx = s->ctx;
    int dev = sim_phys(ctx->dev);
    pthread_mutex_lock(&s->mu);
    wait_foreign_dep(s);
    /* The lane is FIFO: work queued after the stream's tail (and, for the legacy stream, after
     * the blocking streams' work) starts after it. Pacing compares with the served position seen
     * at the last launch; only when that says "too far ahead" is the scheduler asked (and slept on). */
    uint64_t tail = atomic_load(&s->tail);
    if (tail > s->served_hint + G.queue_ahead_ns) /* the pushbuffer is full: wait for the device */
        sim_lane_wait(ctx, tail - G.queue_ahead_ns);
    uint64_t oldest = s->ends[s->pace_idx];
    if (oldest > s->served_hint) sim_lane_wait(ctx, oldest);
    uint64_t served;
    uint64_t end = sim_sched_submit(dev, G.slot, dur_ns, &served);
    s->served_hint = served;
    atomic_fetch_add_explicit(&sim_shm->dev[dev].launches, 1, memory_order_relaxed);
    atomic_store(&s->tail, end);
    s->ends[s->pace_idx] = end;
    s->pace_idx = (s->pace_idx + 1) % SIM_PACE;
    sim_atomic_max(&ctx->tail_all, end);
    if (is_blocking(s)) sim_atomic_max(&ctx->tail_blocking, end);
    pthread_mutex_unlock(&s->mu);
}

uint64_t sim_stream_sync_target(struct CUstream_st *s) {
    uint64_t t = atomic_load(&s->tail);
    if (s->kind == STREAM_LEGACY) t = sim_max64(t, atomic_load(&s->ctx->tail_blocking));
    return t;
}

void sim_stream_drain(struct CUstream_st *s) {
    pthread_mutex_lock(&s->mu);
    wait_foreign_dep(s);
    pthread_mutex_unlock(&s->mu);
    sim_lane_wait(s->ctx, sim_stream_sync_target(s));
}

static int stream_done(struct CUstream_st *s) {
    if (s->dep_pos && sim_sched_served(s->dep_dev, G.slot) < s->dep_pos) return 0;
    return sim_sched_served(sim_phys(s->ctx->dev), G.slot) >= sim_stream_sync_target(s);
}

/* fork: the free lists' locks must not be inherited held by a thread that does not exist there. */
void sim_stream_fork_prepare(void) {
    pthread_mutex_lock(&free_mu);
    pthread_mutex_lock(&ev_mu);
}

void sim_stream_fork_parent(void) {
    pthread_mutex_unlock(&ev_mu);
    pthread_mutex_unlock(&free_mu);
}

void sim_stream_fork_child(void) {
    pthread_mutex_init(&ev_mu, NULL);
    pthread_mutex_init(&free_mu, NULL);
}

static void (*on_sync)(int dev);

void sim_stream_on_sync(void (*fn)(int dev)) { on_sync = fn; }

void sim_after_sync(struct CUctx_st *ctx) {
    if (ctx && on_sync) on_sync(ctx->dev);
}

CUresult sim_stream_wait(struct CUstream_st *s) {
    if (s->capturing) {
        s->capture_invalid = 1; /* synchronising a capturing stream is illegal and ends the capture */
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    sim_stream_drain(s);
    sim_after_sync(s->ctx);
    return CUDA_SUCCESS;
}

static CUresult stream_create(CUstream *ph, unsigned flags, int priority) {
    if (!ph || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    /* H100 stream priorities range from 0 (least) to -5 (greatest); others are clamped. */
    if (priority > 0) priority = 0;
    if (priority < -5) priority = -5;
    struct CUstream_st *s = sim_stream_new(c, STREAM_USER, flags, priority);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    *ph = s;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) { return stream_create(phStream, Flags, 0); }
SIM_EXPORT CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
    return stream_create(phStream, flags, priority);
}

SIM_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_OWNED_VALID(hStream, MAGIC_STREAM) || hStream->kind != STREAM_USER) return CUDA_ERROR_INVALID_HANDLE;
    /* Work still queued completes on its own (its end times live in the context's tails). */
    sim_stream_release(hStream);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamDestroy(CUstream hStream) { return cuStreamDestroy_v2(hStream); }

static CUresult stream_sync(CUstream h, int ptds) {
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    return rc != CUDA_SUCCESS ? rc : sim_stream_wait(s);
}

SIM_EXPORT CUresult cuStreamSynchronize(CUstream hStream) { return stream_sync(hStream, 0); }
SIM_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hStream) { return stream_sync(hStream, 1); }

static CUresult stream_query(CUstream h, int ptds) {
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (s->capturing) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return stream_done(s) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_EXPORT CUresult cuStreamQuery(CUstream hStream) { return stream_query(hStream, 0); }
SIM_EXPORT CUresult cuStreamQuery_ptsz(CUstream hStream) { return stream_query(hStream, 1); }

static CUresult stream_wait_event(CUstream h, CUevent e, unsigned flags, int ptds) {
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_OWNED_VALID(e, MAGIC_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    if (flags > 1) /* CU_EVENT_WAIT_DEFAULT, CU_EVENT_WAIT_EXTERNAL */
        return CUDA_ERROR_INVALID_VALUE;
    if (s->capturing || !atomic_load(&e->recorded))
        return CUDA_SUCCESS; /* nothing to wait for (a captured wait adds no modelled time) */
    /* Later work of the stream starts after the event's work completes: in the same lane that is
     * FIFO order already, and the stream's sync target moves to the event's position. */
    pthread_mutex_lock(&s->mu);
    if (e->dev == sim_phys(s->ctx->dev)) {
        sim_atomic_max(&s->tail, atomic_load(&e->pos));
    } else if (!atomic_load(&e->t)) {
        wait_foreign_dep(s); /* at most one foreign wait pending per stream */
        s->dep_dev = e->dev;
        s->dep_pos = atomic_load(&e->pos);
    }
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    return stream_wait_event(hStream, hEvent, Flags, 0);
}
SIM_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    return stream_wait_event(hStream, hEvent, Flags, 1);
}

/* ---------------------------------------------------------------- events */

/* Destroyed events are recycled through a free list (never freed: stale handles fail validation). */
static struct CUevent_st *ev_free;
struct ev_link {
    struct CUevent_st ev;
    struct CUevent_st *next;
};

SIM_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    if (!phEvent || (Flags & ~0x7u)) return CUDA_ERROR_INVALID_VALUE;
    if ((Flags & 0x4u) && !(Flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_VALUE; /* interprocess events must disable timing */
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&ev_mu);
    struct CUevent_st *e = ev_free;
    if (e) ev_free = ((struct ev_link *)e)->next;
    pthread_mutex_unlock(&ev_mu);
    if (!e) {
        struct ev_link *l = calloc(1, sizeof *l);
        if (!l) return CUDA_ERROR_OUT_OF_MEMORY;
        e = &l->ev;
    }
    e->flags = Flags;
    e->ctx = c;
    e->ctx_serial = c->serial;
    e->dev = sim_phys(c->dev);
    atomic_store(&e->pos, 0);
    atomic_store(&e->t, 0);
    atomic_store(&e->recorded, 0);
    e->gen = sim_gen();
    e->magic = MAGIC_EVENT;
    *phEvent = e;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventDestroy_v2(CUevent hEvent) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_OWNED_VALID(hEvent, MAGIC_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    hEvent->magic = MAGIC_DEAD;
    pthread_mutex_lock(&ev_mu);
    ((struct ev_link *)hEvent)->next = ev_free;
    ev_free = hEvent;
    pthread_mutex_unlock(&ev_mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventDestroy(CUevent hEvent) { return cuEventDestroy_v2(hEvent); }

static CUresult event_record(CUevent e, CUstream h, int ptds) {
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_OWNED_VALID(e, MAGIC_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    if (s->capturing) return CUDA_SUCCESS; /* event nodes are not modelled in graphs */
    /* The event completes when the stream's queued work does. On an idle stream it is a command
     * the device processes when this process's lane next holds the device, as a GPU writes an
     * event's timestamp when the context's channel is scheduled: a 1 ns marker in the lane (so an
     * event recorded just before a launch, while a neighbour holds the device, completes when the
     * kernel starts, not while it waits). Its time is resolved when it is seen done. */
    int dev = sim_phys(s->ctx->dev);
    uint64_t pos = sim_stream_sync_target(s);
    atomic_store(&e->recorded, 0);
    e->dev = dev;
    if (s->dep_pos == 0 && sim_sched_served(dev, G.slot) >= pos) {
        uint64_t served;
        pos = sim_sched_submit(dev, G.slot, 1, &served);
    }
    atomic_store(&e->pos, pos);
    atomic_store(&e->t, 0);
    atomic_store(&e->recorded, 1);
    return CUDA_SUCCESS;
}

/* 1 when the recorded work is done; fixes the event's completion time the first time it is seen
 * done (from the lane's service history, or now if the history no longer has it). */
static int event_done(struct CUevent_st *e) {
    if (atomic_load(&e->t)) return 1;
    uint64_t pos = atomic_load(&e->pos);
    if (sim_sched_served(e->dev, G.slot) < pos) return 0;
    uint64_t t = sim_sched_done_time(e->dev, G.slot, pos);
    uint64_t zero = 0;
    atomic_compare_exchange_strong(&e->t, &zero, t ? t : sim_now_ns());
    return 1;
}

SIM_EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, 0); }
SIM_EXPORT CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, 1); }
/* flags: CU_EVENT_RECORD_DEFAULT (0) or CU_EVENT_RECORD_EXTERNAL (1: a node of its own in a
 * captured graph; captured event records add no nodes here, so it records as the default does) */
SIM_EXPORT CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags) {
    return flags > 1 ? CUDA_ERROR_INVALID_VALUE : event_record(hEvent, hStream, 0);
}
SIM_EXPORT CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags) {
    return flags > 1 ? CUDA_ERROR_INVALID_VALUE : event_record(hEvent, hStream, 1);
}

SIM_EXPORT CUresult cuEventSynchronize(CUevent hEvent) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_OWNED_VALID(hEvent, MAGIC_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    if (atomic_load(&hEvent->recorded) && !atomic_load(&hEvent->t)) {
        sim_sched_wait(hEvent->dev, G.slot, atomic_load(&hEvent->pos));
        event_done(hEvent);
    }
    sim_after_sync(sim_current_ctx());
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventQuery(CUevent hEvent) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_OWNED_VALID(hEvent, MAGIC_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    if (atomic_load(&hEvent->recorded) && !event_done(hEvent)) return CUDA_ERROR_NOT_READY;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_OWNED_VALID(hStart, MAGIC_EVENT) || !SIM_OWNED_VALID(hEnd, MAGIC_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    if ((hStart->flags | hEnd->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    if (!atomic_load(&hStart->recorded) || !atomic_load(&hEnd->recorded)) return CUDA_ERROR_INVALID_HANDLE;
    if (!event_done(hStart) || !event_done(hEnd)) return CUDA_ERROR_NOT_READY;
    uint64_t a = atomic_load(&hStart->t), b = atomic_load(&hEnd->t);
    *pMilliseconds = (float)(((double)b - (double)a) / 1e6);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    return cuEventElapsedTime_v2(pMilliseconds, hStart, hEnd);
}

/* ---------------------------------------------------------------- simulator-only ground truth */

/* Not a CUDA function (no cuda.h counterpart; found only by dlsym): the device time this process
 * was actually served on `dev` within the complete 50 ms buckets of [from_ns, to_ns)
 * (CLOCK_MONOTONIC), and the length of those buckets. Tests and benchmarks use it as the ground
 * truth of a process's share of the device, which the kernel-duration spread and the time
 * slicing make impossible to compute from launch counts. */
SIM_EXPORT CUresult simgpuProcessBusyNs(CUdevice dev, unsigned long long from_ns, unsigned long long to_ns,
                                        unsigned long long *busy_ns, unsigned long long *window_ns) {
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!busy_ns || !window_ns || to_ns < from_ns) return CUDA_ERROR_INVALID_VALUE;
    if (G.slot < 0) return CUDA_ERROR_INVALID_CONTEXT;
    uint64_t w;
    *busy_ns = sim_sched_busy_between(sim_phys(dev), G.slot, from_ns, to_ns, &w);
    *window_ns = w;
    return CUDA_SUCCESS;
}

/*
 * The device scheduler: processes time-slice a simulated GPU, as contexts do on a GPU without
 * MPS (compute preemption at time-slice expiry, Pascal and later).
 *
 * Each process (node slot) has one lane per device holding its work in submission order: every
 * stream and context of the process on that device, FIFO (stream order and the NULL stream's
 * implicit synchronisation are preserved, since a FIFO of all submissions respects them). Lanes
 * with pending work take the device in turn, round robin in slot order, for a time slice of
 * SIMGPU_TIMESLICE_US (default 2 ms) each; a lane that runs out of work hands the device on at
 * once, and a lane alone on the device keeps it. So a 100 us kernel of process B launched while
 * process A runs a 20 ms kernel completes within one slice plus 100 us, and A's kernel ends
 * 100 us later than it would have alone.
 *
 * The state (sim_run) is a pure function of the launches and the clock: it is advanced lazily,
 * to "now", by whoever takes the device's lock (a launch, a synchronisation, a query, NVML), and
 * the advancing process writes the busy intervals it lets happen into the utilisation rings.
 * A position in a lane (cumulative device time queued) is done once the lane's served time
 * reaches it; its completion *time* is not fixed when the work is queued (a neighbour's later
 * launch can take slices before it), so synchronisation sleeps until the predicted time and then
 * checks again, and queries always compare positions, never a stale time.
 *
 * Robustness: the lock is a robust process-shared mutex. A holder killed mid-update can leave at
 * most one step inconsistent (one lane credited up to one slice, or a busy interval unrecorded);
 * the next locker clamps every field into range and goes on. Work a dead process left queued
 * (at most its streams' queue-ahead) still runs, as a killed context's last kernels do.
 */
#include "sched.h"

#include "busy.h"
#include "util.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define SLICE_MIN_US 100ull
#define SLICE_MAX_US 1000000ull

static _Atomic uint64_t g_slice_ns;

uint64_t sim_sched_slice_ns(void) {
    uint64_t v = atomic_load_explicit(&g_slice_ns, memory_order_relaxed);
    if (v) return v;
    uint64_t us = sim_env_u64("SIMGPU_TIMESLICE_US", 2000);
    if (us < SLICE_MIN_US || us > SLICE_MAX_US) {
        sim_log("environment SIMGPU_TIMESLICE_US=%llu is out of range; allowed: %llu .. %llu microseconds; using 2000",
                (unsigned long long)us, SLICE_MIN_US, SLICE_MAX_US);
        us = 2000;
    }
    atomic_store_explicit(&g_slice_ns, us * 1000ull, memory_order_relaxed);
    return us * 1000ull;
}

static int lane_ok(int dev, int slot) {
    return sim_shm && dev >= 0 && dev < SIM_MAX_DEVICES && slot >= 0 && slot < SIM_MAX_PROCS;
}

static __thread int t_sched_held; /* a thread holds at most one scheduler lock at a time */
static _Atomic int g_sched_wedged[SIM_MAX_DEVICES];

static void sched_lock(sim_sched *q) {
    int rc = sim_robust_lock(&q->lock, &g_sched_wedged[q - sim_shm->sched], "a device scheduler's");
    t_sched_held = rc != 0;
    if (rc != 1) {
        /* The holder died mid-update (2), or holds the lock and does not return (0): bring every
         * field back into range (see the top). */
        sim_run *r = &q->run;
        if (r->owner < -1 || r->owner >= SIM_MAX_PROCS) r->owner = -1;
        for (int i = 0; i < SIM_MAX_PROCS; i++) {
            if (r->pend[i] > q->lane[i].submitted) r->pend[i] = q->lane[i].submitted;
            uint64_t bit = 1ull << (i % 64);
            if (r->pend[i])
                r->active[i / 64] |= bit;
            else
                r->active[i / 64] &= ~bit;
        }
        if (rc == 2) pthread_mutex_consistent(&q->lock);
    }
}

static void sched_unlock(sim_sched *q) {
    if (t_sched_held) pthread_mutex_unlock(&q->lock);
    t_sched_held = 0;
}

/* The next lane after `o` (cyclically, `o` itself last) with pending work, or -1. */
static int next_active(const sim_run *r, int o) {
    for (int k = 1; k <= SIM_MAX_PROCS; k++) {
        int i = (o + k + SIM_MAX_PROCS) % SIM_MAX_PROCS;
        if (r->active[i / 64] & (1ull << (i % 64))) return i;
    }
    return -1;
}

static void note_segment(sim_lane *l, uint64_t t0, uint64_t s0, uint64_t len) {
    if (l->seg_count) {
        sim_seg *last = &l->seg[(l->seg_count - 1) % SIM_SEGS];
        if (last->t0 + last->len == t0 && last->s0 + last->len == s0) {
            last->len += len; /* the lane kept the device: one segment */
            return;
        }
    }
    sim_seg *g = &l->seg[l->seg_count % SIM_SEGS];
    g->t0 = t0;
    g->s0 = s0;
    g->len = len;
    l->seg_count++;
}

/* Each process mirrors the service history of its own lanes into a longer private one whenever
 * it takes a device's lock (every launch, query and synchronisation does; a waiting thread wakes
 * at least every WAIT_RECHECK_NS), so an event's completion time is still known when it is asked
 * for long after, however many slices other processes took meanwhile. Guarded by the device's
 * scheduler lock (only one thread of the process holds it at a time). */
#define HIST            4096
#define WAIT_RECHECK_NS (50 * 1000000ull)
static struct {
    int slot;
    uint64_t count; /* shared segments mirrored so far */
    sim_seg *h;     /* h[c % HIST] = segment number c */
} g_hist[SIM_MAX_DEVICES];

static void mirror_locked(sim_sched *q, int dev, int slot) {
    const sim_lane *l = &q->lane[slot];
    if (!g_hist[dev].h) {
        g_hist[dev].h = calloc(HIST, sizeof(sim_seg));
        if (!g_hist[dev].h) return;
        g_hist[dev].slot = -1;
    }
    uint64_t n = l->seg_count;
    if (g_hist[dev].slot != slot || g_hist[dev].count > n) { /* a new slot (fork child): start over */
        g_hist[dev].slot = slot;
        g_hist[dev].count = 0;
    }
    uint64_t from = g_hist[dev].count ? g_hist[dev].count - 1 : 0; /* the last may have grown */
    if (n > SIM_SEGS && from < n - SIM_SEGS) from = n - SIM_SEGS;
    for (uint64_t c = from; c < n; c++) g_hist[dev].h[c % HIST] = l->seg[c % SIM_SEGS];
    g_hist[dev].count = n;
}

/* Busy time a run on a copy adds up for one lane (-1: any) within [from, to) (sim_sched_project). */
typedef struct {
    int lane;
    uint64_t from, to, busy;
} span_acc;

/* Run the device from r->t to `until`. `stop` >= 0: stop as soon as that lane has at most
 * `stop_pend` pending and return the time (a prediction on a copy). `q` non-NULL: the real run,
 * recording service history and busy time; `acc` non-NULL: a run on a copy adding up busy time.
 * Returns the time reached. */
static uint64_t run(sim_run *r, uint64_t until, int stop, uint64_t stop_pend, sim_sched *q, int dev, span_acc *acc) {
    uint64_t slice = sim_sched_slice_ns();
    while (r->t < until) {
        if (stop >= 0 && r->pend[stop] <= stop_pend) return r->t;
        if (r->owner < -1 || r->owner >= SIM_MAX_PROCS) r->owner = -1; /* never an index out of range */
        int o = r->owner;
        int own = o >= 0 && r->pend[o] > 0;
        if (!own || r->t >= r->slice_end) {
            int nx = next_active(r, o < 0 ? -1 : o);
            if (nx < 0) { /* nothing queued: idle until `until` */
                r->owner = -1;
                r->t = until;
                break;
            }
            if (nx == o && own) /* alone: keeps the device; slices go on on its grid */
                r->slice_end += ((r->t - r->slice_end) / slice + 1) * slice;
            else
                r->slice_end = r->t + slice;
            r->owner = o = nx;
        }
        uint64_t n = r->pend[o];
        if (stop == o) n -= stop_pend;
        if (n > r->slice_end - r->t) n = r->slice_end - r->t;
        if (n > until - r->t) n = until - r->t;
        if (q) {
            sim_lane *l = &q->lane[o];
            note_segment(l, r->t, l->submitted - r->pend[o], n);
            sim_busy_record(dev, o, r->t, r->t + n);
        }
        if (acc && (acc->lane < 0 || acc->lane == o)) {
            uint64_t a = r->t > acc->from ? r->t : acc->from, b = r->t + n < acc->to ? r->t + n : acc->to;
            if (b > a) acc->busy += b - a;
        }
        r->pend[o] -= n;
        if (!r->pend[o]) r->active[o / 64] &= ~(1ull << (o % 64));
        r->t += n;
    }
    if (r->t < until) r->t = until;
    return r->t;
}

static void advance_locked(sim_sched *q, int dev, uint64_t now) {
    if (now > q->run.t) run(&q->run, now, -1, 0, q, dev, NULL);
}

/* Lock device `dev`'s scheduler, run it to now, mirror the slot's history; returns it locked. */
static sim_sched *lock_now(int dev, int slot, uint64_t *now) {
    sim_sched *q = &sim_shm->sched[dev];
    *now = sim_now_ns();
    sched_lock(q);
    advance_locked(q, dev, *now);
    mirror_locked(q, dev, slot);
    return q;
}

uint64_t sim_sched_submit(int dev, int slot, uint64_t dur_ns, uint64_t *served) {
    if (!lane_ok(dev, slot)) {
        *served = 0;
        return 0;
    }
    uint64_t now;
    sim_sched *q = lock_now(dev, slot, &now);
    sim_lane *l = &q->lane[slot];
    uint64_t pend = q->run.pend[slot];
    *served = l->submitted - pend;
    if (dur_ns) {
        l->submitted += dur_ns;
        q->run.pend[slot] = pend + dur_ns;
        q->run.active[slot / 64] |= 1ull << (slot % 64);
    }
    uint64_t pos = l->submitted;
    sched_unlock(q);
    return pos;
}

uint64_t sim_sched_served(int dev, int slot) {
    if (!lane_ok(dev, slot)) return UINT64_MAX;
    uint64_t now;
    sim_sched *q = lock_now(dev, slot, &now);
    uint64_t s = q->lane[slot].submitted - q->run.pend[slot];
    sched_unlock(q);
    return s;
}

uint64_t sim_sched_eta(int dev, int slot, uint64_t pos) {
    if (!lane_ok(dev, slot)) return 0;
    uint64_t now;
    sim_sched *q = lock_now(dev, slot, &now);
    uint64_t sub = q->lane[slot].submitted;
    uint64_t eta = 0;
    if (pos > sub - q->run.pend[slot]) {
        /* Predict on a copy with the work queued now (it always finishes: no new work arrives). */
        sim_run copy = q->run;
        uint64_t left = pos < sub ? sub - pos : 0;
        eta = run(&copy, UINT64_MAX / 2, slot, left, NULL, dev, NULL);
        if (eta <= now) eta = now + 1;
    }
    sched_unlock(q);
    return eta;
}

void sim_sched_wait(int dev, int slot, uint64_t pos) {
    uint64_t eta;
    while ((eta = sim_sched_eta(dev, slot, pos)) != 0) {
        uint64_t cap = sim_now_ns() + WAIT_RECHECK_NS; /* keeps the private history mirrored */
        sim_sleep_until_ns(eta < cap ? eta : cap);
    }
}

uint64_t sim_sched_done_time(int dev, int slot, uint64_t pos) {
    if (!lane_ok(dev, slot)) return 0;
    uint64_t now, t = 0;
    sim_sched *q = lock_now(dev, slot, &now);
    (void)now;
    if (g_hist[dev].h && g_hist[dev].slot == slot) {
        /* newest first; segments are in increasing served order */
        uint64_t n = g_hist[dev].count, oldest = n > HIST ? n - HIST : 0;
        for (uint64_t c = n; c-- > oldest;) {
            const sim_seg *g = &g_hist[dev].h[c % HIST];
            if (pos > g->s0 && pos <= g->s0 + g->len) {
                t = g->t0 + (pos - g->s0);
                break;
            }
            if (pos > g->s0 + g->len) break; /* it fell in a gap or before the history: unknown */
        }
    }
    sched_unlock(q);
    return t;
}

void sim_sched_advance(int dev) {
    if (!sim_shm || dev < 0 || dev >= SIM_MAX_DEVICES) return;
    sim_sched *q = &sim_shm->sched[dev];
    uint64_t now = sim_now_ns();
    sched_lock(q);
    advance_locked(q, dev, now);
    sched_unlock(q);
}

uint64_t sim_sched_busy_between(int dev, int slot, uint64_t from, uint64_t to, uint64_t *window_ns) {
    sim_sched_advance(dev);
    return sim_busy_between(dev, slot, from, to, window_ns);
}

uint64_t sim_sched_project(sim_run *r, uint64_t now, int lane, uint64_t from, uint64_t to) {
    /* A copy read without the lock may be anything (a torn read, a writer's garbage): keep the
     * run bounded. A state nobody advanced for longer than the busy rings' history starts from
     * there (work older than that cannot count anyway). */
    uint64_t horizon = (uint64_t)SIM_DEV_RING * SIM_BUCKET_NS;
    if (now > horizon && r->t < now - horizon) r->t = now - horizon;
    if (r->t >= now) return 0;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        uint64_t bit = 1ull << (i % 64);
        r->active[i / 64] = r->pend[i] ? r->active[i / 64] | bit : r->active[i / 64] & ~bit;
    }
    span_acc acc = {.lane = lane, .from = from, .to = to, .busy = 0};
    run(r, now, -1, 0, NULL, 0, &acc);
    return acc.busy;
}

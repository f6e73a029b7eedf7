/*
 * Compute-cap controller: budget, cost estimator, elastic share. See compute_controller.h and
 * docs/compute.md. No CUDA calls here.
 */
#include <string.h>

#include "compute_controller.h"

#include <stdbool.h>

/* ---------------------------------------------------------------- budget */

int64_t vc_reserve(int64_t *tat, int64_t now_ns, uint64_t cost_ns, uint32_t permille, int64_t burst_ns) {
    return vc_reserve_step(tat, now_ns, vc_wall_ns((int64_t)cost_ns, permille), burst_ns);
}

void vc_correct(int64_t *tat, int64_t now_ns, int64_t delta_ns, uint32_t permille) {
    if (delta_ns == 0) return;
    int64_t step = vc_wall_ns(delta_ns < 0 ? -delta_ns : delta_ns, permille);
    if (delta_ns < 0) step = -step;
    int64_t old = __atomic_load_n(tat, __ATOMIC_RELAXED);
    for (;;) {
        int64_t next = old + step;
        /* A credit never takes tat below now (idle earns nothing; see vc_reserve), and a debt
         * never pushes it further than VC_MAX_DEBT_NS ahead: a bogus measurement must not
         * freeze the slice. */
        if (step < 0 && next < now_ns) next = old < now_ns ? old : now_ns;
        if (step > 0 && next > now_ns + VC_MAX_DEBT_NS)
            next = now_ns + VC_MAX_DEBT_NS > old ? now_ns + VC_MAX_DEBT_NS : old;
        if (next == old) return;
        if (__atomic_compare_exchange_n(tat, &old, next, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return;
    }
}

void vc_reset(int64_t *tat, int64_t now_ns) { __atomic_store_n(tat, now_ns, __ATOMIC_RELEASE); }

/* ------------------------------------------------------------- estimator */

static uint64_t hash_key(uintptr_t key, uint64_t grid) {
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ull;
    h ^= grid + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2);
    h ^= h >> 29;
    return h;
}

struct vc_est_entry *vc_est_lookup(struct vc_estimator *t, uintptr_t key, uint64_t grid) {
    uint64_t h = hash_key(key, grid);
    struct vc_est_entry *empty = NULL, *idle_lru = NULL, *lru = NULL;
    t->clock++;
    for (unsigned i = 0; i < VC_EST_PROBE; i++) {
        struct vc_est_entry *e = &t->e[(h + i) & (VC_EST_SLOTS - 1)];
        if (e->key == key && e->grid == grid) {
            e->last_use = t->clock;
            return e;
        }
        if (e->key == 0) {
            if (!empty) empty = e;
            continue;
        }
        if (e->in_flight == 0 && (!idle_lru || e->last_use < idle_lru->last_use)) idle_lru = e;
        if (!lru || e->last_use < lru->last_use) lru = e;
    }
    /* Prefer a free slot, then the least recently used entry with nothing in flight. Evicting an
     * entry with launches in flight only loses their later estimate update. */
    struct vc_est_entry *victim = empty ? empty : idle_lru ? idle_lru : lru;
    *victim = (struct vc_est_entry){.key = key, .grid = grid, .last_use = t->clock};
    __atomic_store_n(&t->gen, t->gen + 1, __ATOMIC_RELEASE);
    return victim;
}

uint64_t vc_est_cost(const struct vc_est_entry *e) {
    if (e->samples == 0) return VC_DEFAULT_COST_NS;
    return e->est_ns < 1.0 ? 1 : (uint64_t)(e->est_ns + 0.5);
}

/* Robust mean. Kernel durations vary from run to run (clocks, memory contention: tens of
 * percent), and a device shared by time-slicing adds the neighbours' slices to a measured
 * duration (the kernel waited behind, or was preempted by, someone else's work), never removes
 * any. So:
 *  - the charged estimate `est_ns` is a running mean (1/32 weight once warm) of the accepted
 *    samples: unbiased under run-to-run variation;
 *  - a sample further above the estimate than the kernel's own variation goes (VC_REJECT_SPREADS
 *    times the mean absolute deviation of the accepted samples, within VC_REJECT_MIN..MAX of the
 *    estimate, +10 us) waited for someone else's work: it is rejected (charged the estimate
 *    instead). The bound is MAX (1.8x) until a key has VC_MEAN_WEIGHT accepted samples and while
 *    under VC_FAR_RATE of its samples go beyond 1.8x (alone on the device: then a tighter bound
 *    would only cut the kernel's own slow runs from the mean, charging ~1% too little). With
 *    others' work lengthening samples it tightens: run-to-run variation of 20% (mean deviation
 *    ~16%: a bound of ~1.55x) goes that far about once in a hundred runs; a neighbour's 2 ms
 *    slice makes a short kernel's sample several times its length, and a smaller tenant's single
 *    kernel inside a larger tenant's kernel adds most of a kernel (a fixed 1.8x bound accepted
 *    many of those: it charges the larger of two tenants at 30/70 10-17% too much);
 *  - the kernel really got slower when VC_REJECT_RUN samples in a row are rejected: the
 *    estimate re-bases on the smallest of them.
 * What this cannot see (a long kernel preempted in every sample by a busy neighbour) the NVML
 * outer loop corrects (compute_nvml.c). */
#define VC_REJECT_SPREADS 3.5
#define VC_REJECT_MIN     0.25
#define VC_REJECT_MAX     0.8
#define VC_REJECT_ABS_NS  10000.0
#define VC_FAR_WEIGHT     256.0 /* running rate of samples beyond the widest bound ... */
#define VC_FAR_RATE       0.005 /* ... above which others' work is taken to be lengthening samples */
#define VC_MEAN_WEIGHT    32
#define VC_REJECT_RUN     16

uint64_t vc_est_update(struct vc_est_entry *e, uint64_t sample_ns, int *accepted) {
    double s = (double)sample_ns;
    int ok = 1;
    if (e->samples == 0) {
        e->est_ns = e->low_ns = e->mean_ns = s;
        e->dev_ns = 0;
        e->accepted = 1;
    } else {
        if (s < e->low_ns) e->low_ns = s;
        /* The widest bound until the spread is learned, and while hardly any sample is beyond it
         * (nobody else's work lengthens them: the bound only has to pass the kernel's own rare
         * slow runs, which a tighter one would cut from the mean). */
        double spread = VC_REJECT_MAX;
        if (e->accepted >= VC_MEAN_WEIGHT) { /* not while the estimate itself is being learned */
            double far = e->est_ns * (1.0 + VC_REJECT_MAX) + VC_REJECT_ABS_NS;
            e->far_rate += ((s > far ? 1.0 : 0.0) - e->far_rate) / VC_FAR_WEIGHT;
            if (e->far_rate > VC_FAR_RATE && e->est_ns > 0) spread = VC_REJECT_SPREADS * e->dev_ns / e->est_ns;
        }
        if (spread < VC_REJECT_MIN) spread = VC_REJECT_MIN;
        if (spread > VC_REJECT_MAX) spread = VC_REJECT_MAX;
        double hi = e->est_ns * (1.0 + spread) + VC_REJECT_ABS_NS;
        if (s <= hi) {
            uint32_t n = e->accepted < VC_MEAN_WEIGHT - 1 ? e->accepted + 1 : VC_MEAN_WEIGHT;
            /* Once learned, the spread is learned from the samples at or below the estimate
             * only (twice the weight: about half the samples are): others' work lengthens
             * samples and never shortens them, so these are all the kernel's own runs. Samples
             * above it include inflated ones accepted under the bound; their deviations widened
             * the bound, which accepted more of them: beside a 30% slice a 70% slice's
             * estimate ran up to 1.2x its kernel and its deviation to 0.35 of it. */
            double d = s > e->est_ns ? s - e->est_ns : e->est_ns - s;
            if (e->accepted < VC_MEAN_WEIGHT)
                e->dev_ns += (d - e->dev_ns) / (double)n;
            else if (s <= e->est_ns)
                e->dev_ns += (d - e->dev_ns) * 2.0 / (double)n;
            e->est_ns += (s - e->est_ns) / (double)n;
            if (e->accepted < UINT32_MAX) e->accepted++;
            e->reject_run = 0;
        } else {
            ok = 0;
            if (e->reject_run == 0 || s < e->reject_min_ns) e->reject_min_ns = s;
            if (e->reject_run == 0 || s > e->reject_max_ns) e->reject_max_ns = s;
            e->reject_run++;
            if (e->reject_run >= VC_REJECT_RUN) {
                e->low_ns = e->est_ns = e->reject_min_ns;
                e->dev_ns = e->reject_max_ns - e->reject_min_ns; /* unknown: wide until learned */
                e->accepted = 1;
                e->reject_run = 0;
            }
        }
        e->mean_ns += (s - e->mean_ns) * 0.05;
    }
    if (e->samples < UINT32_MAX) e->samples++;
    if (accepted) *accepted = ok;
    return vc_est_cost(e);
}

/* ------------------------------------------------------ NVML outer loop */

/* What one reading's rounding can add up to: 1 point, +0.5 per further process. */
static double nvml_deadband_pm(int nprocs) { return VC_NVML_DEADBAND_PM + 5.0 * (nprocs > 1 ? nprocs - 1 : 0); }

double vc_nvml_factor(double factor, double usage_pm, double charged_pm, int nprocs) {
    if (charged_pm < VC_NVML_MIN_USAGE_PM || usage_pm < VC_NVML_MIN_USAGE_PM)
        return factor; /* smUtil is an integer percent per process: too coarse below 5% */
    double deadband = nvml_deadband_pm(nprocs);
    double diff = usage_pm - charged_pm;
    if (diff <= deadband && diff >= -deadband) return factor;
    /* linear, not ratio^gain: libm's exp/log carry glibc 2.29 symbol versions, newer than the
     * shim's glibc bound (tests/shim/test_glibc_bound.py) */
    double f = factor * (1.0 + VC_NVML_GAIN * (usage_pm / charged_pm - 1.0));
    if (f < VC_NVML_FACTOR_MIN) f = VC_NVML_FACTOR_MIN;
    if (f > VC_NVML_FACTOR_MAX) f = VC_NVML_FACTOR_MAX;
    return f;
}

double vc_nvml_step(struct vc_nvml_acc *acc, double factor, double usage_pm, double charged_pm, int nprocs,
                    double cap_pm) {
    if (usage_pm < VC_NVML_MIN_USAGE_PM || charged_pm < VC_NVML_MIN_USAGE_PM) {
        acc->periods = 0;
        return factor;
    }
    if (acc->periods <= 0 || acc->periods >= VC_NVML_ACC_MAX) *acc = (struct vc_nvml_acc){0};
    acc->usage_pm += usage_pm;
    acc->charged_pm += charged_pm;
    acc->periods++;
    /* A disagreement of a few percent waits for VC_NVML_MIN_PERIODS readings: one period's
     * noise (rounding, work charged in one period and served in the next) is then a third of
     * the sums' and moves the factor a third as far; a large one is acted on at once. */
    double ratio = acc->usage_pm / acc->charged_pm;
    if (acc->periods < VC_NVML_MIN_PERIODS && ratio < 1.0 + VC_NVML_FAST && ratio > 1.0 - VC_NVML_FAST) return factor;
    double f = vc_nvml_factor(factor, acc->usage_pm, acc->charged_pm, nprocs);
    /* Costs go up only when the slice used more than its cap: charged less than it used but
     * within its cap, it was held by the device (its neighbours' shares), not by the bucket, and
     * its events read lower there than at its cap (kernels preempted more often), so a factor
     * learned there overcharged it once it reached its cap: the 70% slice of a 30/70 pair then
     * got 68-69%. The sums go on; they act once its use goes over, summed or in the latest
     * reading alone (sums of a long light phase would otherwise hide a slice that just went over
     * its cap until they are emptied, up to VC_NVML_ACC_MAX periods). */
    double db = nvml_deadband_pm(nprocs);
    if (f > factor && acc->usage_pm <= cap_pm * acc->periods + db && usage_pm <= cap_pm + db) return factor;
    if (f != factor) acc->periods = 0;
    return f;
}

/* ---------------------------------------------------------- elastic share */

static bool slot_wants(const struct vgpu_node_slot *s, int64_t now_ns) {
    return __atomic_load_n(&s->slice_id, __ATOMIC_ACQUIRE) != 0 &&
           __atomic_load_n(&s->want_until_ns, __ATOMIC_ACQUIRE) > now_ns;
}

uint32_t vc_elastic_permille(const struct vgpu_node_slot *slots, size_t nslots, int self, int64_t now_ns) {
    if (self < 0 || (size_t)self >= nslots) return 0; /* no slot: the caller applies its own cap */
    const struct vgpu_node_slot *me = &slots[self];
    uint32_t my_cap = __atomic_load_n(&me->cap_permille, __ATOMIC_RELAXED);
    int32_t my_prio = __atomic_load_n(&me->priority, __ATOMIC_RELAXED);
    uint64_t my_id = __atomic_load_n(&me->slice_id, __ATOMIC_ACQUIRE);
    if (my_cap == 0 || my_cap > VC_PERMILLE_FULL) my_cap = VC_PERMILLE_FULL;

    uint32_t reserved = my_cap; /* guaranteed shares of everyone who wants time, mine included */
    unsigned peers = 1;         /* elastic slices of my priority that want time, me included */
    bool outranked = false;     /* an elastic slice of higher priority wants time */
    for (size_t i = 0; i < nslots; i++) {
        if ((int)i == self || !slot_wants(&slots[i], now_ns)) continue;
        /* A second slot of my own slice (two of its processes claimed at once, until
         * vc_node_recheck merges them) is me, not a neighbour. */
        if (my_id && __atomic_load_n(&slots[i].slice_id, __ATOMIC_ACQUIRE) == my_id) continue;
        uint32_t cap = __atomic_load_n(&slots[i].cap_permille, __ATOMIC_RELAXED);
        uint32_t pol = __atomic_load_n(&slots[i].policy, __ATOMIC_RELAXED);
        int32_t prio = __atomic_load_n(&slots[i].priority, __ATOMIC_RELAXED);
        if (cap == 0 || cap > VC_PERMILLE_FULL || pol == VGPU_COMPUTE_POLICY_OFF) cap = VC_PERMILLE_FULL;
        reserved += cap;
        if (pol == VGPU_COMPUTE_POLICY_ELASTIC) {
            if (prio < my_prio)
                outranked = true;
            else if (prio == my_prio)
                peers++;
        }
    }
    if (reserved >= VC_PERMILLE_FULL || outranked) return my_cap;
    uint32_t extra = (VC_PERMILLE_FULL - reserved) / peers;
    uint32_t eff = my_cap + extra;
    /* Alone (or all idle share is mine): no cap at all, not 99.9%. */
    if (peers == 1 && eff >= VC_PERMILLE_FULL - 1) return VC_PERMILLE_FULL;
    return eff > VC_PERMILLE_FULL ? VC_PERMILLE_FULL : eff;
}

/* ---------------------------------------------------------- demand records */

int vc_peer_demand(const struct vgpu_demand_file *f, size_t len, const uint8_t uuid[16], int64_t now_ns,
                   struct vgpu_node_slot *out) {
    static const uint8_t zero[16];
    if (len < sizeof *f || f->magic != VGPU_DEMAND_MAGIC || f->version != VGPU_DEMAND_VERSION ||
        memcmp(uuid, zero, 16) == 0)
        return 0;
    for (size_t i = 0; i < sizeof f->dev / sizeof f->dev[0]; i++) {
        const struct vgpu_demand_entry *e = &f->dev[i];
        if (memcmp(e->uuid, uuid, 16) != 0) continue;
        /* The first entry for the device is the record (a second one is ignored: one file is one
         * slice). A record out of range is not believed at all: it can then only cost its
         * writer, whose guaranteed share nobody sees wanted. */
        const struct vgpu_node_slot *d = &e->d;
        if (d->slice_id == 0 || d->cap_permille == 0 || d->cap_permille > VC_PERMILLE_FULL ||
            d->policy > VGPU_COMPUTE_POLICY_ELASTIC || d->priority < -100 || d->priority > 100)
            return 0;
        /* A want further ahead than any live shim writes is a stale clock (an earlier boot) or a
         * lie; a liar must keep rewriting its record to be believed. */
        if (d->want_until_ns > now_ns + VC_WANT_AHEAD_MAX_NS) return 0;
        *out = *d;
        return 1;
    }
    return 0;
}

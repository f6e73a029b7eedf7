/*
 * The compute-cap controller: pure logic, no CUDA calls, no I/O, so it can be tested against a
 * plant model (tests/c/compute_controller_test.c) and reasoned about on its own.
 *
 * Three parts:
 *  1. The budget: a virtual-time bucket (GCRA with reservation) shared by every process of a
 *     slice through the accounting file. A launch of estimated device time c under cap p
 *     advances the slice's theoretical arrival time (tat) by c/p of wall time; the launch may
 *     go once tat (before its own charge) is within `burst` of now. Over any window in which
 *     the slice is throttled, charged device time / wall time = p exactly; the caller makes
 *     charged time track real device time (part 2).
 *  2. The cost estimator: per launch key (CUfunction + grid size, or CUgraphExec) an estimate of
 *     device time learned from measured completions. Measured durations on a shared device are
 *     inflated whenever the kernel queued behind someone else's work (time-slicing), never
 *     deflated, so the estimate is a robust mean of the samples near their lower envelope rather
 *     than their mean: only samples near the lower envelope feed the estimate.
 *  3. The elastic share: given the demand records of the slices on one device, the cap this
 *     slice may apply now (its own cap, plus idle share that nobody with a higher priority wants).
 */
#ifndef VGPU_COMPUTE_CONTROLLER_H
#define VGPU_COMPUTE_CONTROLLER_H

#include <stddef.h>
#include <stdint.h>

#include "vgpu/compute_state.h"

#define VC_PERMILLE_FULL 1000u

/* ---- 1. budget ---- */

/* Reserve budget for one launch of `cost_ns` device time under `permille` (1..999).
 * Lock-free (CAS on *tat). Returns the CLOCK_MONOTONIC time at which the launch may go;
 * a value <= now means "go now". `burst_ns` is how far ahead of its schedule a slice may run
 * (it also absorbs late wake-ups of sleeping threads, so they lose no budget). */
int64_t vc_reserve(int64_t *tat, int64_t now_ns, uint64_t cost_ns, uint32_t permille, int64_t burst_ns);

/* Apply a correction of `delta_ns` device time (positive: the launch cost more than charged).
 * Lock-free. The debt is bounded to VC_MAX_DEBT_NS of wall time ahead of now. */
void vc_correct(int64_t *tat, int64_t now_ns, int64_t delta_ns, uint32_t permille);

/* Forget accumulated debt or credit (used when an elastic slice goes back to its cap). */
void vc_reset(int64_t *tat, int64_t now_ns);

#define VC_MAX_DEBT_NS 10000000000LL /* 10 s */

/* Wall time a launch of cost_ns occupies in the budget of a cap of permille. */
static inline int64_t vc_wall_ns(int64_t cost_ns, uint32_t permille) {
    if (permille == 0) permille = 1;
    /* 64-bit when the multiply cannot overflow (every real cost: a launch's is far below 2^53
     * ns), else __int128 (exact for any input); both truncate alike. */
    if (cost_ns > -(INT64_MAX / VC_PERMILLE_FULL) && cost_ns < INT64_MAX / VC_PERMILLE_FULL)
        return cost_ns * VC_PERMILLE_FULL / (int64_t)permille;
    return (int64_t)(((__int128)cost_ns * VC_PERMILLE_FULL) / permille);
}

/* vc_reserve with the launch's wall time already known (step = vc_wall_ns(cost_ns, permille)):
 * the launch gate keeps the step of its cached cost, so that a launch does no division. */
static inline int64_t vc_reserve_step(int64_t *tat, int64_t now_ns, int64_t step, int64_t burst_ns) {
    int64_t old = __atomic_load_n(tat, __ATOMIC_RELAXED);
    for (;;) {
        /* Idle time earns no credit beyond `burst`: a slice that was idle starts from now. */
        int64_t base = old > now_ns ? old : now_ns;
        if (__atomic_compare_exchange_n(tat, &old, base + step, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            /* The launch may go once the work reserved before it is within burst of paid. */
            return base - burst_ns;
        /* `old` was reloaded by the failed CAS; retry (another process/thread reserved). */
    }
}

/* ---- 2. estimator ---- */

#define VC_EST_SLOTS       1024 /* power of two */
#define VC_EST_PROBE       8
#define VC_DEFAULT_COST_NS 20000 /* charged for a key never measured (and only one may be in flight) */

struct vc_est_entry {
    uintptr_t key;        /* CUfunction / CUgraphExec; 0 = empty */
    uint64_t grid;        /* total blocks (0 for graphs) */
    double est_ns;        /* charged estimate: running mean of the accepted samples */
    double low_ns;        /* smallest sample (diagnostics) */
    double mean_ns;       /* plain EWMA of all samples, for diagnostics */
    double dev_ns;        /* running mean absolute deviation of the accepted samples from est_ns */
    double far_rate;      /* running rate of samples beyond the widest rejection bound */
    double reject_min_ns; /* smallest sample of the current run of rejected ones */
    double reject_max_ns; /* largest sample of that run */
    uint32_t samples;     /* completions measured */
    uint32_t accepted;    /* samples that fed est_ns */
    uint32_t reject_run;  /* rejected samples in a row */
    uint32_t in_flight;   /* measured launches admitted whose completion was not read yet */
    uint32_t seq;         /* launches of this key (for measuring one in N) */
    uint64_t last_use;    /* for eviction */
};

struct vc_estimator {
    struct vc_est_entry e[VC_EST_SLOTS];
    uint64_t clock; /* use counter */
    /* Changes whenever an entry is (re)assigned to a key (vc_est_lookup) and, by the caller,
     * whenever an estimate changes (vc_est_update): a copy of an entry's estimate taken with this
     * value is still the table's while it is unchanged. Written by the owner of the table, read
     * atomically by anyone. */
    uint64_t gen;
};

/* Find or create the entry of (key, grid). Never NULL: evicts the least recently used of the
 * probed slots when the table is full. */
struct vc_est_entry *vc_est_lookup(struct vc_estimator *t, uintptr_t key, uint64_t grid);

/* The cost to charge for one launch of this entry (ns). */
uint64_t vc_est_cost(const struct vc_est_entry *e);

/* The NVML outer loop's control law (compute_nvml.c): given the cost factor in force, the
 * slice's share of the device by the driver's per-process utilisation (usage_pm, permille;
 * nprocs processes, each rounded to an integer percent) and what it was charged (charged_pm),
 * both summed over the consecutive periods not yet acted on, the new factor: VC_NVML_GAIN of
 * the way (linearly) to factor x usage / charged, within [VC_NVML_FACTOR_MIN,
 * VC_NVML_FACTOR_MAX]; unchanged below 5% or while the sums differ by no more than one
 * reading's rounding (1 point, +0.5 per further process): a small bias adds up over periods
 * until it is corrected, rounding noise does not. */
#define VC_NVML_MIN_USAGE_PM 50.0
#define VC_NVML_DEADBAND_PM  10.0
#define VC_NVML_GAIN         0.6
#define VC_NVML_FACTOR_MIN   0.2
#define VC_NVML_FACTOR_MAX   5.0
double vc_nvml_factor(double factor, double usage_pm, double charged_pm, int nprocs);

/* One reading of the NVML outer loop: the slice's usage and charge over the last period
 * (permille) are added to the sums not yet acted on (`acc`; zeroed = empty), and the factor
 * moves by vc_nvml_factor on the sums. A reading under 5% empties the sums and changes nothing;
 * the sums are emptied when the factor moves, and after VC_NVML_ACC_MAX readings (older ones
 * are forgotten). The caller empties them when a reading is not the next period of the last.
 * cap_pm: the slice's cap in force (permille); the factor rises only when the usage is over
 * the cap by more than the rounding, summed or in the latest reading alone; it falls whenever
 * the slice was charged too much. */
#define VC_NVML_ACC_MAX 30
/* Sums of fewer than VC_NVML_MIN_PERIODS readings that disagree by less than VC_NVML_FAST
 * (relative) are not acted on yet: one period also carries work charged in it but served in the
 * next (up to the burst a throttled slice queues ahead: 1.4 points of a 70% slice), and acting
 * on single readings moved a 70% slice's factor 2-4% a second beside a 30% slice (the device
 * idled while the 70% slice was throttled by a high factor). */
#define VC_NVML_MIN_PERIODS 3
#define VC_NVML_FAST        0.05
struct vc_nvml_acc {
    double usage_pm, charged_pm;
    int periods;
};
double vc_nvml_step(struct vc_nvml_acc *acc, double factor, double usage_pm, double charged_pm, int nprocs,
                    double cap_pm);

/* Feed one measured duration. Returns the new estimate (ns); *accepted (if not NULL) = 1 when
 * the sample is taken as the kernel's own time, 0 when it is rejected as inflated by waiting for
 * other work (then the launch is charged the estimate instead). */
uint64_t vc_est_update(struct vc_est_entry *e, uint64_t sample_ns, int *accepted);

/* ---- 3. elastic share ---- */

/* The cap this slice applies now on one device, in permille (1000 = no cap).
 * `self` is this slice's slot index (or -1 when it has none), `now_ns` the time.
 * Rules (docs/compute.md): a slice always keeps its own cap. Idle share = 1000 minus the caps
 * of every other slice that wants time now (an uncapped or `off` slice counts as 1000). It goes
 * to the elastic slices that want time, highest priority first; slices of equal priority split
 * it evenly. Hard slices never take idle share. */
uint32_t vc_elastic_permille(const struct vgpu_node_slot *slots, size_t nslots, int self, int64_t now_ns);

/* ---- 4. demand records ----
 * Each slice publishes its demand in a file of its own (struct vgpu_demand_file); an elastic slice
 * reads the files of the others (a copy: never a mapping another tenant could truncate under it). */

#define VC_WANT_AHEAD_MAX_NS 1000000000LL /* a want_until further ahead than this is not believed */

/* The demand of the slice whose file content is `f` (len bytes read) on the device `uuid`, into
 * *out: 1 when it has a believable record for the device, 0 when not (no record, a corrupt or
 * out-of-range one, or a want_until too far ahead). Only the first record for the device counts. */
int vc_peer_demand(const struct vgpu_demand_file *f, size_t len, const uint8_t uuid[16], int64_t now_ns,
                   struct vgpu_node_slot *out);

#endif

/*
 * Kernel durations. A kernel's modelled time:
 *
 *   a function named sim_<N>us (also as the identifier of an Itanium-mangled name, e.g.
 *   _Z9sim_500usPf) runs N microseconds per wave, any other name 10 us per wave, and
 *   waves = ceil(total blocks / SM count).
 *
 * Durations vary, as on hardware (clocks, memory contention, interrupts): each launch draws its
 * duration from a lognormal distribution whose mean is the modelled time, with a coefficient of
 * variation of SIMGPU_KERNEL_SPREAD_PCT (default 20 %), and with probability
 * SIMGPU_KERNEL_TAIL_PPM (default 1000 per million) it takes SIMGPU_KERNEL_TAIL_FACTOR (default 4)
 * times as long; the draws are scaled so the mean stays the modelled time. SIMGPU_SEED makes the
 * draws reproducible (thread i of a process gets the i-th stream of the seed); spread 0 and tail 0
 * give exact durations. The generator is per thread (splitmix64): no lock, no system call.
 */
#include "duration.h"

#include "init.h"

#include "../common/util.h"

#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#define MAX_KERNEL_NS (10ull * 1000000000ull) /* one launch occupies at most 10 s (see ring_add) */

/* ------------------------------------------------------------ duration distribution */
static struct {
    double sigma, mu; /* of the lognormal factor: mean 1, CV = spread */
    uint64_t tail_ppm;
    double tail_factor;
    double norm; /* 1 / E[tail multiplier]: keeps the mean at the modelled time */
    int exact;
    int seeded;
    uint64_t seed;
} dist;
static pthread_once_t dist_once = PTHREAD_ONCE_INIT;
static _Atomic uint64_t rng_threads;
static __thread uint64_t rng_state;
static __thread int rng_ready;

static uint64_t knob_max(const char *name, uint64_t dflt, uint64_t max) {
    uint64_t v = sim_env_u64(name, dflt);
    if (v > max) {
        sim_log("environment %s=%llu is out of range; allowed: 0 .. %llu; using %llu", name, (unsigned long long)v,
                (unsigned long long)max, (unsigned long long)dflt);
        v = dflt;
    }
    return v;
}

static void dist_init(void) {
    double cv = (double)knob_max("SIMGPU_KERNEL_SPREAD_PCT", 20, 200) / 100.0;
    dist.tail_ppm = knob_max("SIMGPU_KERNEL_TAIL_PPM", 1000, 1000000);
    uint64_t f = sim_env_u64("SIMGPU_KERNEL_TAIL_FACTOR", 4);
    if (f < 1 || f > 100) {
        sim_log("environment SIMGPU_KERNEL_TAIL_FACTOR=%llu is out of range; allowed: 1 .. 100; using 4",
                (unsigned long long)f);
        f = 4;
    }
    dist.tail_factor = (double)f;
    dist.sigma = sqrt(log1p(cv * cv));
    dist.mu = -dist.sigma * dist.sigma / 2;
    double p = (double)dist.tail_ppm / 1e6;
    dist.norm = 1.0 / (1.0 - p + p * dist.tail_factor);
    dist.exact = cv == 0 && (dist.tail_ppm == 0 || f == 1);
    const char *seed = getenv("SIMGPU_SEED");
    if (seed && *seed) {
        dist.seeded = 1;
        dist.seed = sim_env_u64("SIMGPU_SEED", 0);
    }
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rng_next(void) {
    if (!rng_ready) {
        uint64_t idx = atomic_fetch_add_explicit(&rng_threads, 1, memory_order_relaxed);
        uint64_t base =
            dist.seeded ? dist.seed : sim_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&rng_state;
        uint64_t x = base ^ (idx * 0xd1b54a32d192ed03ull);
        rng_state = splitmix64(&x);
        rng_ready = 1;
    }
    return splitmix64(&rng_state);
}

static double unit_open(void) { return ((double)(rng_next() >> 11) + 0.5) * 0x1.0p-53; } /* (0, 1) */

uint64_t sim_kernel_sample_ns(uint64_t mean_ns) {
    pthread_once(&dist_once, dist_init);
    if (dist.exact || mean_ns == 0) return mean_ns;
    double f = 1.0;
    if (dist.sigma > 0) { /* Box-Muller: one standard normal draw */
        double z = sqrt(-2.0 * log(unit_open())) * cos(6.283185307179586 * unit_open());
        f = exp(dist.mu + dist.sigma * z);
    }
    if (dist.tail_ppm && rng_next() % 1000000u < dist.tail_ppm) f *= dist.tail_factor;
    double ns = (double)mean_ns * f * dist.norm;
    if (ns >= (double)MAX_KERNEL_NS) return MAX_KERNEL_NS;
    return ns < 1.0 ? 1 : (uint64_t)ns;
}

uint64_t sim_kernel_ns(const struct CUfunc_st *f, uint64_t blocks, int dev) {
    uint64_t sms = (uint64_t)G.cfg->dev[dev].sm_count;
    uint64_t waves = (blocks + sms - 1) / sms;
    if (waves > MAX_KERNEL_NS / 1000 || f->us_per_wave > MAX_KERNEL_NS / 1000) return MAX_KERNEL_NS;
    unsigned __int128 ns = (unsigned __int128)f->us_per_wave * 1000u * waves;
    return ns > MAX_KERNEL_NS ? MAX_KERNEL_NS : (uint64_t)ns;
}

/*
 * Kernel launches. The simulator runs no device code; a launch occupies the device timeline:
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
 *
 * Processes time-slice the device (common/sched.c); a process's own work runs in submission
 * order; see stream.c for placement and pacing.
 *
 * A launch also costs the calling thread host CPU time, as the real driver's does (writing the
 * pushbuffer): SIMGPU_LAUNCH_COST_NS (default 3000 ns) of busy time, spent reading the vDSO clock
 * (no system call), so an interposer's overhead per launch is compared with a realistic launch.
 * The work is queued at the end of that time (the doorbell), not at its start.
 */
#include "cuda_internal.h"

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

static CUresult launch(CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shmem, CUstream h, void **params, void **extra, int ptds, int coop) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    struct CUfunc_st *f = sim_func_resolve(fn);
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz) return CUDA_ERROR_INVALID_VALUE;
    if (gy > 65535 || gz > 65535 || bx > 1024 || by > 1024 || bz > 64 || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (shmem > 228u * 1024u) return CUDA_ERROR_INVALID_VALUE;
    if (params && extra) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s;
    rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    int dev = s->ctx->dev;
    uint64_t blocks = (uint64_t)gx * gy * gz;
    if (coop) {
        /* all blocks must be co-resident: at most 2048 threads per SM */
        uint64_t per_sm = 2048u / ((uint64_t)bx * by * bz);
        if (per_sm == 0 || blocks > per_sm * (uint64_t)G.cfg->dev[dev].sm_count)
            return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
    }
    struct CUgraphNode_st node = {.type = NODE_KERNEL, .dur_ns = sim_kernel_ns(f, blocks, dev)};
    if (f->dur_arg && params) node.dur_ns = sim_arg_kernel_ns(f, params, blocks, dev);
    if (s->capturing) {
        sim_capture_add(s, &node);
        return CUDA_SUCCESS;
    }
    /* The host cost comes first: the driver writes the launch into the pushbuffer and rings the
     * doorbell last, so the device cannot start the kernel before the call is nearly over. */
    uint64_t t0 = G.launch_cost_ns ? sim_now_ns() : 0;
    while (G.launch_cost_ns && sim_now_ns() - t0 < G.launch_cost_ns) {}
    sim_stream_enqueue(s, sim_kernel_sample_ns(node.dur_ns));
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                   unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                  kernelParams, extra, 0, 0);
}

SIM_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                        void **kernelParams, void **extra) {
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                  kernelParams, extra, 1, 0);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                              unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                              unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                              void **kernelParams) {
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                  kernelParams, NULL, 0, 1);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                   unsigned int gridDimZ, unsigned int blockDimX,
                                                   unsigned int blockDimY, unsigned int blockDimZ,
                                                   unsigned int sharedMemBytes, CUstream hStream, void **kernelParams) {
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                  kernelParams, NULL, 1, 1);
}

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra, int ptds) {
    if (!config || (config->numAttrs && !config->attrs)) return CUDA_ERROR_INVALID_VALUE;
    int coop = 0;
    for (unsigned i = 0; i < config->numAttrs; i++)
        if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && config->attrs[i].value.cooperative)
            coop = 1; /* other attributes (priority, clusters, ...) do not change the modelled time */
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                  config->blockDimZ, config->sharedMemBytes, config->hStream, kernelParams, extra, ptds, coop);
}

SIM_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    return launch_ex(config, f, kernelParams, extra, 0);
}

SIM_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                          void **extra) {
    return launch_ex(config, f, kernelParams, extra, 1);
}

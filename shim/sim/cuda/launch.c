/*
 * Kernel launches. The simulator runs no device code; a launch occupies the device timeline:
 *
 *   a function named sim_<N>us (also as the identifier of an Itanium-mangled name, e.g.
 *   _Z9sim_500usPf) runs N microseconds per wave, any other name 10 us per wave, and
 *   waves = ceil(total blocks / SM count).
 *
 * All launches on a device, from every process and context, run one after another on one
 * timeline (time-slicing, as a GPU without MPS); see stream.c for placement and pacing.
 *
 * A launch also costs the calling thread host CPU time, as the real driver's does (writing the
 * pushbuffer): SIMGPU_LAUNCH_COST_NS (default 3000 ns) of busy time, spent reading the vDSO clock
 * (no system call), so an interposer's overhead per launch is compared with a realistic launch.
 */
#include "cuda_internal.h"

#define MAX_KERNEL_NS (10ull * 1000000000ull) /* one launch occupies at most 10 s (see ring_add) */

uint64_t sim_kernel_ns(const struct CUfunc_st *f, uint64_t blocks, int dev)
{
    uint64_t sms = (uint64_t)G.cfg->dev[dev].sm_count;
    uint64_t waves = (blocks + sms - 1) / sms;
    if (waves > MAX_KERNEL_NS / 1000 || f->us_per_wave > MAX_KERNEL_NS / 1000)
        return MAX_KERNEL_NS;
    unsigned __int128 ns = (unsigned __int128)f->us_per_wave * 1000u * waves;
    return ns > MAX_KERNEL_NS ? MAX_KERNEL_NS : (uint64_t)ns;
}

static CUresult launch(CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shmem, CUstream h, void **params, void **extra, int ptds, int coop)
{
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct CUfunc_st *f = sim_func_resolve(fn);
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz)
        return CUDA_ERROR_INVALID_VALUE;
    if (gy > 65535 || gz > 65535 || bx > 1024 || by > 1024 || bz > 64 || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (shmem > 228u * 1024u)
        return CUDA_ERROR_INVALID_VALUE;
    if (params && extra)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s;
    rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    int dev = s->ctx->dev;
    uint64_t blocks = (uint64_t)gx * gy * gz;
    if (coop) {
        /* all blocks must be co-resident: at most 2048 threads per SM */
        uint64_t per_sm = 2048u / ((uint64_t)bx * by * bz);
        if (per_sm == 0 || blocks > per_sm * (uint64_t)G.cfg->dev[dev].sm_count)
            return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
    }
    struct CUgraphNode_st node = { .type = NODE_KERNEL, .dur_ns = sim_kernel_ns(f, blocks, dev) };
    if (s->capturing) {
        sim_capture_add(s, &node);
        return CUDA_SUCCESS;
    }
    uint64_t t0 = G.launch_cost_ns ? sim_now_ns() : 0;
    sim_stream_enqueue(s, node.dur_ns);
    while (G.launch_cost_ns && sim_now_ns() - t0 < G.launch_cost_ns) {
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                   unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra, 0, 0);
}

SIM_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                        unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra, 1, 0);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                              unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                              unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, NULL, 0, 1);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                                   unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                                   unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, NULL, 1, 1);
}

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra, int ptds)
{
    if (!config || (config->numAttrs && !config->attrs))
        return CUDA_ERROR_INVALID_VALUE;
    int coop = 0;
    for (unsigned i = 0; i < config->numAttrs; i++)
        if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && config->attrs[i].value.cooperative)
            coop = 1; /* other attributes (priority, clusters, ...) do not change the modelled time */
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                  config->blockDimZ, config->sharedMemBytes, config->hStream, kernelParams, extra, ptds, coop);
}

SIM_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    return launch_ex(config, f, kernelParams, extra, 0);
}

SIM_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    return launch_ex(config, f, kernelParams, extra, 1);
}

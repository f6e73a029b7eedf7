/*
 * Kernel launches. The simulator runs no device code; a launch occupies the device timeline for
 * its kernel's duration (duration.c, argdur.c).
 *
 * Processes time-slice the device (common/sched.c); a process's own work runs in submission
 * order; see stream.c for placement and pacing.
 *
 * A launch also costs the calling thread host CPU time, as the real driver's does (writing the
 * pushbuffer): SIMGPU_LAUNCH_COST_NS (default 3000 ns) of busy time, spent reading the vDSO clock
 * (no system call), so an interposer's overhead per launch is compared with a realistic launch.
 * The work is queued at the end of that time (the doorbell), not at its start.
 */
#include "argdur.h"
#include "duration.h"
#include "graph.h"
#include "init.h"
#include "module.h"
#include "stream.h"

#include "../common/util.h"

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

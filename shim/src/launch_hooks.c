/*
 * The launch paths of the compute cap: every way work reaches the device's SMs goes through
 * vgpu_compute_before/after (compute.c). A graph pays for all of its kernels: its cost is learned
 * per CUgraphExec from measured completions. Cooperative kernels are kernels.
 *
 * Fast path: when no cap is configured (or control is disabled) a hook is vgpu_init() (one
 * atomic load after the first call), one flag test and the tail call to the driver.
 * Arguments are never dereferenced before the driver has seen them, except config of
 * cuLaunchKernelEx, which is checked for NULL first (NULL goes straight to the driver, which
 * reports the error).
 */
#include "compute.h"
#include "launch_hooks.h"
#include "hooks.h"
#include "init.h"
#include "symbols.h"

/* Per-thread default stream: the _ptsz entry points read stream 0 as the calling thread's
 * stream. Our events must go to the same stream through the default-version cuEventRecord. */
static inline CUstream ptsz_stream(CUstream s) { return s ? s : CU_STREAM_PER_THREAD; }

#define PASSTHROUGH_OR_FAIL(sym, args)                                                                                 \
    do {                                                                                                               \
        CUresult init_rc_ = vgpu_init();                                                                               \
        if (init_rc_ != CUDA_SUCCESS) return init_rc_;                                                                 \
        if (!real_##sym) return CUDA_ERROR_NOT_SUPPORTED;                                                              \
        /* vgpu_compute_on stays 0 when control is disabled (the compute init never runs). */                          \
        if (!vgpu_compute_on) return real_##sym args;                                                                  \
    } while (0)

/* A NULL function or graph goes straight to the driver, which reports the error: nothing runs. */
#define GATED(sym, key, shape, stream, args)                                                                           \
    do {                                                                                                               \
        if (!(key)) return real_##sym args;                                                                            \
        struct vgpu_launch L_;                                                                                         \
        vgpu_compute_before(&L_, (uintptr_t)(key), (shape), (stream));                                                 \
        CUresult r_ = real_##sym args;                                                                                 \
        vgpu_compute_after(&L_, r_);                                                                                   \
        return r_;                                                                                                     \
    } while (0)

CUresult hook_cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                             unsigned int by, unsigned int bz, unsigned int smem, CUstream s, void **params,
                             void **extra) {
    PASSTHROUGH_OR_FAIL(cuLaunchKernel, (f, gx, gy, gz, bx, by, bz, smem, s, params, extra));
    GATED(cuLaunchKernel, f, vgpu_launch_shape(gx, gy, gz, bx, by, bz), s,
          (f, gx, gy, gz, bx, by, bz, smem, s, params, extra));
}

CUresult hook_cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                  unsigned int by, unsigned int bz, unsigned int smem, CUstream s, void **params,
                                  void **extra) {
    PASSTHROUGH_OR_FAIL(cuLaunchKernel_ptsz, (f, gx, gy, gz, bx, by, bz, smem, s, params, extra));
    GATED(cuLaunchKernel_ptsz, f, vgpu_launch_shape(gx, gy, gz, bx, by, bz), ptsz_stream(s),
          (f, gx, gy, gz, bx, by, bz, smem, s, params, extra));
}

CUresult hook_cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
    PASSTHROUGH_OR_FAIL(cuLaunchKernelEx, (config, f, params, extra));
    if (!config) return real_cuLaunchKernelEx(config, f, params, extra);
    GATED(cuLaunchKernelEx, f,
          vgpu_launch_shape(config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                            config->blockDimZ),
          config->hStream, (config, f, params, extra));
}

CUresult hook_cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
    PASSTHROUGH_OR_FAIL(cuLaunchKernelEx_ptsz, (config, f, params, extra));
    if (!config) return real_cuLaunchKernelEx_ptsz(config, f, params, extra);
    GATED(cuLaunchKernelEx_ptsz, f,
          vgpu_launch_shape(config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                            config->blockDimZ),
          ptsz_stream(config->hStream), (config, f, params, extra));
}

CUresult hook_cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int smem,
                                        CUstream s, void **params) {
    PASSTHROUGH_OR_FAIL(cuLaunchCooperativeKernel, (f, gx, gy, gz, bx, by, bz, smem, s, params));
    GATED(cuLaunchCooperativeKernel, f, vgpu_launch_shape(gx, gy, gz, bx, by, bz), s,
          (f, gx, gy, gz, bx, by, bz, smem, s, params));
}

CUresult hook_cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                             unsigned int bx, unsigned int by, unsigned int bz, unsigned int smem,
                                             CUstream s, void **params) {
    PASSTHROUGH_OR_FAIL(cuLaunchCooperativeKernel_ptsz, (f, gx, gy, gz, bx, by, bz, smem, s, params));
    GATED(cuLaunchCooperativeKernel_ptsz, f, vgpu_launch_shape(gx, gy, gz, bx, by, bz), ptsz_stream(s),
          (f, gx, gy, gz, bx, by, bz, smem, s, params));
}

CUresult vgpu_launch_graph(CUgraphExec g, CUstream s) /* behind graphmem.c's hook */
{
    PASSTHROUGH_OR_FAIL(cuGraphLaunch, (g, s));
    GATED(cuGraphLaunch, g, 0, s, (g, s));
}

CUresult vgpu_launch_graph_ptsz(CUgraphExec g, CUstream s) {
    PASSTHROUGH_OR_FAIL(cuGraphLaunch_ptsz, (g, s));
    GATED(cuGraphLaunch_ptsz, g, 0, ptsz_stream(s), (g, s));
}

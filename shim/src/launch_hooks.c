/*
 * The launch paths of the compute cap: every way work reaches the device's SMs goes through
 * vgpu_compute_before/after (compute.c). A graph pays for all of its kernels: its cost is learned
 * per CUgraphExec from measured completions. Cooperative kernels are kernels.
 *
 * The stream-capture hooks at the end count the captures in progress (vgpu_compute_captures): the
 * gate asks the driver whether a launch's stream is capturing only while there is one.
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
        VGPU_HOOK_OPEN(real_##sym);                                                                                    \
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

/* ------------------------------------------------------------ stream capture begun and ended */
/* Counted before the driver's call, so that a launch racing the begin asks the driver; taken back
 * when the begin failed. */
#define BEGIN_CAPTURE(sym, args)                                                                                       \
    do {                                                                                                               \
        PASSTHROUGH_OR_FAIL(sym, args);                                                                                \
        vgpu_compute_captures(1);                                                                                      \
        CUresult r_ = real_##sym args;                                                                                 \
        if (r_ != CUDA_SUCCESS) vgpu_compute_captures(-1);                                                             \
        return r_;                                                                                                     \
    } while (0)

CUresult hook_cuStreamBeginCapture(CUstream s) { BEGIN_CAPTURE(cuStreamBeginCapture, (s)); }
CUresult hook_cuStreamBeginCapture_ptsz(CUstream s) { BEGIN_CAPTURE(cuStreamBeginCapture_ptsz, (s)); }
CUresult hook_cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) {
    BEGIN_CAPTURE(cuStreamBeginCapture_v2, (s, mode));
}
CUresult hook_cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode) {
    BEGIN_CAPTURE(cuStreamBeginCapture_v2_ptsz, (s, mode));
}

/* A capture has ended when its stream was capturing before the call and is not after it, whatever
 * the call returned (an invalidated capture ends with an error). When the driver cannot say
 * either time, nothing is taken back: the gate then goes on asking about every launch's stream,
 * which costs a driver call per launch, never a wrong charge. */
#define END_CAPTURE(sym, query_stream, args)                                                                           \
    do {                                                                                                               \
        PASSTHROUGH_OR_FAIL(sym, args);                                                                                \
        int before_ = vgpu_compute_stream_capturing(query_stream);                                                     \
        CUresult r_ = real_##sym args;                                                                                 \
        if (before_ == 1 && vgpu_compute_stream_capturing(query_stream) == 0) vgpu_compute_captures(-1);               \
        return r_;                                                                                                     \
    } while (0)

CUresult hook_cuStreamEndCapture(CUstream s, CUgraph *g) { END_CAPTURE(cuStreamEndCapture, s, (s, g)); }
CUresult hook_cuStreamEndCapture_ptsz(CUstream s, CUgraph *g) {
    END_CAPTURE(cuStreamEndCapture_ptsz, ptsz_stream(s), (s, g));
}

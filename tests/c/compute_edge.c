/*
 * Edge cases of the launch hooks under a compute cap (tests/shim_compute/test_edges.py):
 * NULL arguments reach the driver (no crash, the driver's error comes back), failed launches
 * give their budget back, stream capture is not charged, and fork in the middle of capped
 * launching neither deadlocks the child nor disturbs the parent; contexts destroyed and created
 * between launches are charged right.
 * Prints "ok" and exits 0 on success.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "vgpu/cuda_api.h"

#define EXPECT(cond)                                                                                                   \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "edge: failed: %s (line %d)\n", #cond, __LINE__);                                          \
            return 1;                                                                                                  \
        }                                                                                                              \
    } while (0)

int main(void) {
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    EXPECT(cuInit(0) == CUDA_SUCCESS);
    EXPECT(cuDeviceGet(&dev, 0) == CUDA_SUCCESS);
    EXPECT(cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS);
    EXPECT(cuCtxSetCurrent(ctx) == CUDA_SUCCESS);
    EXPECT(cuModuleLoadData(&mod, "simgpu-module") == CUDA_SUCCESS);
    EXPECT(cuModuleGetFunction(&fn, mod, "sim_1000us") == CUDA_SUCCESS);

    /* NULL arguments: the driver's answer, no crash. */
    EXPECT(cuLaunchKernelEx(NULL, fn, NULL, NULL) != CUDA_SUCCESS);
    EXPECT(cuLaunchKernelEx_ptsz(NULL, fn, NULL, NULL) != CUDA_SUCCESS);
    EXPECT(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS);
    EXPECT(cuGraphLaunch(NULL, NULL) != CUDA_SUCCESS);
    /* A launch the driver refuses (no context current): nothing charged, no crash. */
    EXPECT(cuCtxSetCurrent(NULL) == CUDA_SUCCESS);
    EXPECT(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS);
    EXPECT(cuCtxSetCurrent(ctx) == CUDA_SUCCESS);

    /* Capture: launches recorded into a graph are not charged (they do not run). */
    CUstream cs;
    CUgraph g;
    CUgraphExec ge;
    EXPECT(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    EXPECT(cuStreamBeginCapture_v2(cs, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
    for (int i = 0; i < 200; i++) /* 200 ms of kernels: at a 10% cap that would be 2 s of waiting */
        EXPECT(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, cs, NULL, NULL) == CUDA_SUCCESS);
    EXPECT(cuStreamEndCapture(cs, &g) == CUDA_SUCCESS);
    EXPECT(cuGraphInstantiateWithFlags(&ge, g, 0) == CUDA_SUCCESS);

    for (int i = 0; i < 20; i++) EXPECT(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) == CUDA_SUCCESS);
    fflush(NULL);
    pid_t pid = fork();
    EXPECT(pid >= 0);
    if (pid == 0) {
        /* The child: the parent's context is not ours (CUDA does not survive fork); the hooks
         * must answer, not hang on a lock the parent held. */
        CUresult r = cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
        (void)r;
        _exit(0);
    }
    for (int i = 0; i < 20; i++) EXPECT(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) == CUDA_SUCCESS);
    int status = 0;
    EXPECT(waitpid(pid, &status, 0) == pid);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    EXPECT(cuCtxSynchronize() == CUDA_SUCCESS);

    /* Contexts come and go (the gate keeps the device of a thread's context until a context is
     * destroyed): a launch in a new context, maybe at a destroyed one's address, is charged like
     * any other; one after its context was destroyed is the driver's error, charged nothing. */
    for (int k = 0; k < 3; k++) {
        CUcontext c2;
        CUmodule m2;
        CUfunction f2;
        EXPECT(cuCtxCreate_v2(&c2, 0, dev) == CUDA_SUCCESS); /* current now */
        EXPECT(cuModuleLoadData(&m2, "simgpu-module") == CUDA_SUCCESS);
        EXPECT(cuModuleGetFunction(&f2, m2, "sim_1000us") == CUDA_SUCCESS);
        for (int i = 0; i < 5; i++) EXPECT(cuLaunchKernel(f2, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) == CUDA_SUCCESS);
        EXPECT(cuCtxSynchronize() == CUDA_SUCCESS);
        EXPECT(cuCtxDestroy_v2(c2) == CUDA_SUCCESS);
        EXPECT(cuLaunchKernel(f2, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS);
        EXPECT(cuCtxSetCurrent(ctx) == CUDA_SUCCESS);
    }
    printf("ok\n");
    return 0;
}

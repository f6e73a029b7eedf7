/*
 * A program on NVIDIA's CUDA runtime (libcudart 12 or 13, from the pinned wheels), built as an
 * nvcc-built program is, but host-only with gcc: the kernel is registered the way nvcc's
 * generated host code registers it (__cudaRegisterFatBinary / __cudaRegisterFunction), so no
 * CUDA compiler is needed. The simulator runs no device code: the kernel's name, sim_1000us,
 * sets its duration (1 ms per wave).
 *
 *   cudart_client memory         prints what the runtime reports and what fits:
 *                                "total=T free=F prop_total=P", "fit=N" (64 MiB buffers until the
 *                                first failure), "oom_error=E" (the failing cudaMalloc's error)
 *   cudart_client compute S      launches the kernel for S seconds, prints "share=X"
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* What nvcc's host code declares for kernel registration (crt/host_runtime.h). */
extern void **__cudaRegisterFatBinary(void *fatCubin);
extern void __cudaRegisterFatBinaryEnd(void **fatCubinHandle);
extern void __cudaUnregisterFatBinary(void **fatCubinHandle);
extern void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun, char *deviceFun, const char *deviceName, int thread_limit,
                                   uint3 *tid, uint3 *bid, dim3 *bDim, dim3 *gDim, int *wSize);

/* A fat binary as nvcc embeds it (uncompressed): the container header, then one entry holding
 * the kernel as PTX 8.0 (CUDA 12.0 and later) for compute_90 (the simulated H100). The runtime reads the container to
 * find an image for the device; the simulated driver loads any image and runs nothing. */
#define PTX_TEXT ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry sim_1000us()\n{\nret;\n}\n"
struct fat_entry {
    unsigned short kind, version; /* 1: PTX; 0x0101 */
    unsigned int header_size;     /* 80 */
    unsigned int payload_size;    /* padded to 8 */
    unsigned int reserved0, compressed_size, options_offset, ptx_version, sm_version;
    unsigned int reserved1, reserved2;
    unsigned long long flags;     /* 0x11: 64-bit, Linux, not compressed */
    unsigned long long reserved3, uncompressed_size;
    unsigned long long options_size, reserved4;
};
static struct {
    unsigned int magic;           /* 0xba55ed50 */
    unsigned short version, header_size;
    unsigned long long fat_size;  /* the entries' bytes */
    struct fat_entry entry;
    char ptx[(sizeof PTX_TEXT + 7) / 8 * 8];
} __attribute__((aligned(8))) fatbin = {
    0xba55ed50u, 1, 16, sizeof(struct fat_entry) + (sizeof PTX_TEXT + 7) / 8 * 8,
    { 1, 0x0101, sizeof(struct fat_entry), (sizeof PTX_TEXT + 7) / 8 * 8, 0, 0, 64, 0x80000, 90, 0, 0, 0x11, 0, 0, 0x48, 0 },
    PTX_TEXT,
};
static struct {
    int magic, version;
    const void *data;
    void *filename_or_fatbins;
} wrapper = { 0x466243b1, 1, &fatbin, NULL };

static void **handle;
static void sim_1000us(void) {} /* the host stub: its address identifies the kernel */

static void check(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "%s: %s (%d)\n", what, cudaGetErrorString(e), (int)e);
        exit(1);
    }
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void register_kernel(void)
{
    handle = __cudaRegisterFatBinary(&wrapper);
    __cudaRegisterFunction(handle, (const char *)sim_1000us, (char *)"sim_1000us", "sim_1000us", -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFatBinaryEnd(handle);
}

static int memory(void)
{
    size_t free_b = 0, total = 0;
    check(cudaFree(0), "cudaFree(0)");
    check(cudaMemGetInfo(&free_b, &total), "cudaMemGetInfo");
    struct cudaDeviceProp p;
    check(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties");
    printf("total=%zu free=%zu prop_total=%zu\n", total, free_b, p.totalGlobalMem);
    enum { MAX = 4096 };
    static void *bufs[MAX];
    int n = 0;
    cudaError_t e = cudaSuccess;
    while (n < MAX && (e = cudaMalloc(&bufs[n], 64u << 20)) == cudaSuccess)
        n++;
    printf("fit=%d\n", n);
    printf("oom_error=%d\n", (int)e);
    (void)cudaGetLastError(); /* an allocation failure is not sticky */
    for (int i = 0; i < n; i++)
        check(cudaFree(bufs[i]), "cudaFree");
    void *again;
    check(cudaMalloc(&again, 64u << 20), "cudaMalloc after freeing");
    check(cudaFree(again), "cudaFree");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    return 0;
}

static int compute(double seconds)
{
    check(cudaFree(0), "cudaFree(0)");
    cudaEvent_t a, b;
    check(cudaEventCreate(&a), "cudaEventCreate");
    check(cudaEventCreate(&b), "cudaEventCreate");
    dim3 grid = { 1, 1, 1 }, block = { 32, 1, 1 };
    check(cudaLaunchKernel((const void *)sim_1000us, grid, block, NULL, 0, 0), "cudaLaunchKernel");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    double t0 = now();
    long n = 0;
    check(cudaEventRecord(a, 0), "cudaEventRecord");
    while (now() - t0 < seconds) {
        for (int i = 0; i < 10; i++, n++)
            check(cudaLaunchKernel((const void *)sim_1000us, grid, block, NULL, 0, 0), "cudaLaunchKernel");
    }
    check(cudaEventRecord(b, 0), "cudaEventRecord");
    check(cudaEventSynchronize(b), "cudaEventSynchronize");
    double wall = now() - t0;
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    printf("share=%.1f launches=%ld wall=%.2f events_ms=%.1f\n", 100.0 * (double)n * 0.001 / wall, n, wall, ms);
    return 0;
}

int main(int argc, char **argv)
{
    register_kernel();
    int rv = 2;
    if (argc == 2 && strcmp(argv[1], "memory") == 0)
        rv = memory();
    else if (argc == 3 && strcmp(argv[1], "compute") == 0)
        rv = compute(atof(argv[2]));
    else
        fprintf(stderr, "usage: cudart_client memory | compute SECONDS\n");
    __cudaUnregisterFatBinary(handle);
    return rv;
}

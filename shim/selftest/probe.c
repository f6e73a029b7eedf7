/*
 * vgpu-selftest-probe: the driver-API program `vgpu selftest` (sharing/cli/selftest/) runs, with and
 * without the shim, on whatever libcuda.so.1 and libnvidia-ml.so.1 the loader finds (NVIDIA's,
 * or the simulator's). It opens the driver with dlopen and finds each function with dlsym, as
 * CUDA frameworks do. Every result is one line of key=value pairs on stdout.
 *
 *   probe env DEV                     the driver, the device, its page (VMM granularity)
 *   probe fill DEV ROUTE CHUNK MAX    allocate through ROUTE (plain pitch managed async pool
 *                                     vmm array graph global context) in CHUNK bytes, halving
 *                                     down to one unit after each refusal, until the unit is
 *                                     refused or MAX bytes are held; print what the program sees, then "ready", and
 *                                     hold everything until a line arrives on stdin
 *   probe spin DEV NS SECONDS         launch a kernel that spins NS ns on the GPU's global timer
 *                                     (PTX compiled by the driver) back to back for SECONDS
 *   probe cost DEV N                  thread CPU ns per call of cuMemGetInfo, cuMemAlloc+Free
 *                                     and an empty-spin cuLaunchKernel, N calls each
 *   probe ptx spin | ptx global SIZE  print the PTX the probe gives the driver (to check it with
 *                                     NVIDIA's ptxas)
 *   probe cudart LIB DEV              the CUDA runtime LIB (a libcudart path): device count and
 *                                     cudaMemGetInfo
 * Exit 0 on success, 1 on a CUDA error (named on stderr), 2 on bad usage.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "vgpu/cuda_api.h"
#include "vgpu/nvml_api.h"

#define CU_JIT_ERROR_LOG_BUFFER_            5
#define CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES_ 6
#define MAX_HELD                            8192

/* The spin kernel: every thread reads %globaltimer until NS ns have passed since its start. Its
 * name follows the simulator's convention for kernels whose duration is an argument
 * (docs/simulator.md); on hardware the name means nothing. PTX 6.0 for sm_50: any driver since
 * CUDA 9 compiles it for the GPU it runs on. */
static const char SPIN_PTX[] = ".version 6.0\n"
                               ".target sm_50\n"
                               ".address_size 64\n"
                               ".visible .entry sim_arg0ns(.param .u64 ns)\n"
                               "{\n"
                               "  .reg .pred %p;\n"
                               "  .reg .b64 %t0, %t1, %d, %lim;\n"
                               "  ld.param.u64 %lim, [ns];\n"
                               "  mov.u64 %t0, %globaltimer;\n"
                               "SPIN:\n"
                               "  mov.u64 %t1, %globaltimer;\n"
                               "  sub.u64 %d, %t1, %t0;\n"
                               "  setp.lt.u64 %p, %d, %lim;\n"
                               "  @%p bra SPIN;\n"
                               "  ret;\n"
                               "}\n";

// clang-format off: one driver function a line (the X-macro list of what the probe resolves)
#define CU_FUNCS(X) \
    X(cuInit) \
    X(cuDriverGetVersion) \
    X(cuDeviceGet) \
    X(cuDeviceGetName) \
    X(cuDeviceGetAttribute) \
    X(cuDeviceTotalMem_v2) \
    X(cuDeviceGetPCIBusId) \
    X(cuDevicePrimaryCtxRetain) \
    X(cuCtxSetCurrent) \
    X(cuCtxCreate_v2) \
    X(cuCtxSynchronize) \
    X(cuMemGetInfo_v2) \
    X(cuMemAlloc_v2) \
    X(cuMemFree_v2) \
    X(cuMemAllocPitch_v2) \
    X(cuMemAllocManaged) \
    X(cuMemAllocAsync) \
    X(cuMemPoolCreate) \
    X(cuMemAllocFromPoolAsync) \
    X(cuStreamSynchronize) \
    X(cuMemCreate) \
    X(cuMemGetAllocationGranularity) \
    X(cuArray3DCreate_v2) \
    X(cuGraphCreate) \
    X(cuGraphAddMemAllocNode) \
    X(cuGraphInstantiateWithFlags) \
    X(cuGraphLaunch) \
    X(cuModuleLoadData) \
    X(cuModuleLoadDataEx) \
    X(cuModuleGetFunction) \
    X(cuLaunchKernel) \
    X(cuGetErrorName)
// clang-format on

#define DECLARE(f) static __typeof__(&f) p_##f;
CU_FUNCS(DECLARE)

static void *cuda_lib;

static void die(const char *what, CUresult rc) {
    const char *name = NULL;
    if (p_cuGetErrorName) p_cuGetErrorName(rc, &name);
    fprintf(stderr, "vgpu-selftest-probe: %s: %s (%d)\n", what, name ? name : "unknown error", (int)rc);
    exit(1);
}

#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        CUresult rc_ = (call);                                                                                         \
        if (rc_ != CUDA_SUCCESS) die(#call, rc_);                                                                      \
    } while (0)

static void load_cuda(void) {
    cuda_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cuda_lib) {
        fprintf(stderr, "vgpu-selftest-probe: cannot load libcuda.so.1: %s\n", dlerror());
        exit(1);
    }
#define RESOLVE(f) p_##f = (__typeof__(&f))dlsym(cuda_lib, #f);
    CU_FUNCS(RESOLVE)
    if (!p_cuInit || !p_cuGetErrorName || !p_cuMemGetInfo_v2) {
        fprintf(stderr, "vgpu-selftest-probe: libcuda.so.1 lacks cuInit, cuGetErrorName or cuMemGetInfo_v2\n");
        exit(1);
    }
}

static uint64_t now_ns(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* cuInit, the device, and its primary context made current (as the CUDA runtime does). */
static CUdevice open_device(int ordinal) {
    CUdevice dev;
    CUcontext ctx;
    CHECK(p_cuInit(0));
    CHECK(p_cuDeviceGet(&dev, ordinal));
    CHECK(p_cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(p_cuCtxSetCurrent(ctx));
    return dev;
}

/* Pinned device memory on `dev`: what cuMemCreate allocates and its granularity is asked of. */
static CUmemAllocationProp device_prop(CUdevice dev) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    return prop;
}

static size_t page_of(CUdevice dev) {
    CUmemAllocationProp prop = device_prop(dev);
    size_t g = 0;
    if (!p_cuMemGetAllocationGranularity ||
        p_cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || !g)
        g = 2u << 20; /* what NVIDIA's drivers report; only sizes the fill's smallest step */
    return g;
}

/* What NVML in this process (through the shim: the slice's view) says of the CUDA device `dev`,
 * found by its PCI bus id; 0 and 0 when NVML is not there or does not know the device. */
static void nvml_in_process(CUdevice dev, unsigned long long *total, unsigned long long *used) {
    *total = *used = 0;
    char bus[64] = "";
    if (!p_cuDeviceGetPCIBusId || p_cuDeviceGetPCIBusId(bus, sizeof bus, dev) != CUDA_SUCCESS) return;
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
    __typeof__(&nvmlInit_v2) init = (__typeof__(&nvmlInit_v2))dlsym(h, "nvmlInit_v2");
    __typeof__(&nvmlDeviceGetHandleByPciBusId_v2) get =
        (__typeof__(&nvmlDeviceGetHandleByPciBusId_v2))dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2");
    __typeof__(&nvmlDeviceGetMemoryInfo) mem =
        (__typeof__(&nvmlDeviceGetMemoryInfo))dlsym(h, "nvmlDeviceGetMemoryInfo");
    nvmlDevice_t d;
    nvmlMemory_t m;
    if (init && get && mem && init() == NVML_SUCCESS && get(bus, &d) == NVML_SUCCESS && mem(d, &m) == NVML_SUCCESS) {
        *total = m.total;
        *used = m.used;
    }
}

static int cmd_env(int ordinal) {
    int drv = 0;
    CHECK(p_cuDriverGetVersion(&drv));
    CUdevice dev = open_device(ordinal);
    char name[256] = "";
    int sms = 0, major = 0, minor = 0;
    size_t total = 0, free_ = 0;
    CHECK(p_cuDeviceGetName(name, sizeof name, dev));
    CHECK(p_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    CHECK(p_cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    CHECK(p_cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    CHECK(p_cuMemGetInfo_v2(&free_, &total));
    for (char *c = name; *c; c++)
        if (*c == ' ') *c = '_';
    printf("cuda_driver=%d name=%s sms=%d cc=%d.%d total=%zu free=%zu page=%zu pid=%d\n", drv, name, sms, major, minor,
           total, free_, page_of(dev), (int)getpid());
    return 0;
}

/* A module whose only content is a `size`-byte global: loading it allocates that much. */
static void global_ptx(char *buf, size_t n, size_t size) {
    snprintf(buf, n, ".version 6.0\n.target sm_50\n.address_size 64\n.global .align 8 .b8 fill[%zu];\n", size);
}

static CUstream stream0;
static CUmemoryPool pool;

/* One allocation of `size` bytes through `route`. */
static CUresult alloc_one(const char *route, CUdevice dev, size_t size, size_t page) {
    CUdeviceptr p;
    if (!strcmp(route, "plain")) return p_cuMemAlloc_v2(&p, size);
    if (!strcmp(route, "pitch")) {
        size_t pitch;
        return p_cuMemAllocPitch_v2(&p, &pitch, 64u << 10, size / (64u << 10), 16);
    }
    if (!strcmp(route, "managed")) return p_cuMemAllocManaged(&p, size, CU_MEM_ATTACH_GLOBAL);
    if (!strcmp(route, "async") || !strcmp(route, "pool")) {
        CUresult rc = !strcmp(route, "async") ? p_cuMemAllocAsync(&p, size, stream0)
                                              : p_cuMemAllocFromPoolAsync(&p, size, pool, stream0);
        return rc != CUDA_SUCCESS ? rc : p_cuStreamSynchronize(stream0);
    }
    if (!strcmp(route, "vmm")) {
        CUmemAllocationProp prop = device_prop(dev);
        CUmemGenericAllocationHandle h;
        return p_cuMemCreate(&h, (size + page - 1) / page * page, &prop, 0);
    }
    if (!strcmp(route, "array")) {
        CUDA_ARRAY3D_DESCRIPTOR d;
        memset(&d, 0, sizeof d);
        d.Width = 16384; /* 64 KiB rows of floats */
        d.Height = size / (64u << 10);
        d.Format = CU_AD_FORMAT_FLOAT;
        d.NumChannels = 1;
        CUarray a;
        return p_cuArray3DCreate_v2(&a, &d);
    }
    if (!strcmp(route, "graph")) {
        CUgraph g;
        CUgraphNode n;
        CUgraphExec e;
        CUDA_MEM_ALLOC_NODE_PARAMS np;
        memset(&np, 0, sizeof np);
        np.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        np.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        np.poolProps.location.id = dev;
        np.bytesize = size;
        CUresult rc = p_cuGraphCreate(&g, 0);
        if (rc == CUDA_SUCCESS) rc = p_cuGraphAddMemAllocNode(&n, g, NULL, 0, &np);
        if (rc == CUDA_SUCCESS) rc = p_cuGraphInstantiateWithFlags(&e, g, 0);
        if (rc == CUDA_SUCCESS) rc = p_cuGraphLaunch(e, stream0);
        return rc != CUDA_SUCCESS ? rc : p_cuStreamSynchronize(stream0);
    }
    if (!strcmp(route, "global")) {
        char ptx[256];
        global_ptx(ptx, sizeof ptx, size);
        CUmodule m;
        return p_cuModuleLoadData(&m, ptx);
    }
    if (!strcmp(route, "context")) {
        CUcontext c;
        CUresult rc = p_cuCtxCreate_v2(&c, 0, dev);
        if (rc == CUDA_SUCCESS) { /* the primary context stays the current one */
            CUcontext prim;
            rc = p_cuDevicePrimaryCtxRetain(&prim, dev);
            if (rc == CUDA_SUCCESS) rc = p_cuCtxSetCurrent(prim);
        }
        return rc;
    }
    return CUDA_ERROR_NOT_SUPPORTED;
}

static int cmd_fill(int ordinal, const char *route, size_t chunk, size_t max) {
    CUdevice dev = open_device(ordinal);
    size_t page = page_of(dev);
    if (!strcmp(route, "pool")) {
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = dev;
        CHECK(p_cuMemPoolCreate(&pool, &props));
    }
    size_t free0 = 0, total = 0;
    CHECK(p_cuMemGetInfo_v2(&free0, &total));
    /* A context's unit is what one takes of the quota: learnt from the first one. */
    size_t unit = !strcmp(route, "context") ? 0 : page;
    size_t size = !strcmp(route, "context") ? 1 : (chunk < page ? page : chunk / page * page);
    size_t granted = 0;
    int allocs = 0, refusals = 0;
    CUresult last = CUDA_SUCCESS;
    while (allocs < MAX_HELD && granted < max) { /* past MAX the quota has failed: stop there */
        size_t before = 0, after = 0;
        p_cuMemGetInfo_v2(&before, &total);
        CUresult rc = alloc_one(route, dev, size, page);
        if (rc == CUDA_SUCCESS) {
            allocs++;
            granted += size;
            if (!unit) {
                p_cuMemGetInfo_v2(&after, &total);
                unit = before > after ? before - after : page;
            }
            continue;
        }
        last = rc;
        refusals++;
        if (rc != CUDA_ERROR_OUT_OF_MEMORY || size <= unit || !strcmp(route, "context")) break;
        size = size / 2 < unit ? unit : size / 2 / page * page;
    }
    size_t free_ = 0;
    p_cuMemGetInfo_v2(&free_, &total);
    unsigned long long nvml_total, nvml_used;
    nvml_in_process(dev, &nvml_total, &nvml_used);
    const char *last_name = "CUDA_SUCCESS";
    p_cuGetErrorName(last, &last_name);
    printf("route=%s granted=%zu allocs=%d refusals=%d unit=%zu page=%zu last=%s free_before=%zu free=%zu "
           "total=%zu nvml_total=%llu nvml_used=%llu pid=%d\n",
           route, granted, allocs, refusals, unit ? unit : page, page, last_name ? last_name : "?", free0, free_, total,
           nvml_total, nvml_used, (int)getpid());
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 0;
    return 0;
}

static CUfunction spin_function(void) {
    char log[4096] = "";
    int opts[2] = {CU_JIT_ERROR_LOG_BUFFER_, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES_};
    void *vals[2] = {log, (void *)(uintptr_t)sizeof log};
    CUmodule m;
    CUresult rc = p_cuModuleLoadDataEx(&m, SPIN_PTX, 2, (CUjit_option *)opts, vals);
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "vgpu-selftest-probe: the driver could not compile the spin kernel's PTX: %s\n", log);
        die("cuModuleLoadDataEx", rc);
    }
    CUfunction f;
    CHECK(p_cuModuleGetFunction(&f, m, "sim_arg0ns"));
    return f;
}

static int cmd_spin(int ordinal, unsigned long long ns, double seconds) {
    CUdevice dev = open_device(ordinal);
    int sms = 0;
    CHECK(p_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    CUfunction f = spin_function();
    void *args[1] = {&ns};
    printf("started pid=%d\n", (int)getpid());
    fflush(stdout);
    uint64_t t0 = now_ns(CLOCK_MONOTONIC), end = t0 + (uint64_t)(seconds * 1e9);
    unsigned long long launches = 0;
    while (now_ns(CLOCK_MONOTONIC) < end) {
        /* One block per SM: one wave, every SM busy for ns. No synchronisation in the loop: the
         * driver's queue stays full (a launch blocks when it is), so a host thread that runs late
         * leaves the device idle only once the queue has drained. */
        CHECK(p_cuLaunchKernel(f, (unsigned)sms, 1, 1, 32, 1, 1, 0, NULL, args, NULL));
        launches++;
    }
    CHECK(p_cuCtxSynchronize());
    printf("launches=%llu seconds=%.6f\n", launches, (double)(now_ns(CLOCK_MONOTONIC) - t0) / 1e9);
    return 0;
}

static int cmd_cost(int ordinal, long n) {
    CUdevice dev = open_device(ordinal);
    (void)dev;
    CUfunction f = spin_function();
    unsigned long long zero = 0;
    void *args[1] = {&zero};
    size_t fr, tot;
    CUdeviceptr p;
    uint64_t t = now_ns(CLOCK_THREAD_CPUTIME_ID);
    for (long i = 0; i < n; i++) CHECK(p_cuMemGetInfo_v2(&fr, &tot));
    uint64_t meminfo = now_ns(CLOCK_THREAD_CPUTIME_ID) - t;
    t = now_ns(CLOCK_THREAD_CPUTIME_ID);
    for (long i = 0; i < n; i++) {
        CHECK(p_cuMemAlloc_v2(&p, 1u << 20));
        CHECK(p_cuMemFree_v2(p));
    }
    uint64_t alloc = now_ns(CLOCK_THREAD_CPUTIME_ID) - t;
    t = now_ns(CLOCK_THREAD_CPUTIME_ID);
    for (long i = 0; i < n; i++) CHECK(p_cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, args, NULL));
    uint64_t launch = now_ns(CLOCK_THREAD_CPUTIME_ID) - t;
    CHECK(p_cuCtxSynchronize());
    printf("meminfo_ns=%.1f alloc_free_ns=%.1f launch_ns=%.1f\n", (double)meminfo / (double)n,
           (double)alloc / (double)n, (double)launch / (double)n);
    return 0;
}

typedef int (*rt_count_t)(int *);
typedef int (*rt_setdev_t)(int);
typedef int (*rt_meminfo_t)(size_t *, size_t *);

static int cmd_cudart(const char *path, int ordinal) {
    void *rt = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!rt) {
        fprintf(stderr, "vgpu-selftest-probe: cannot load %s: %s\n", path, dlerror());
        return 1;
    }
    rt_count_t count = (rt_count_t)dlsym(rt, "cudaGetDeviceCount");
    rt_setdev_t setdev = (rt_setdev_t)dlsym(rt, "cudaSetDevice");
    rt_meminfo_t meminfo = (rt_meminfo_t)dlsym(rt, "cudaMemGetInfo");
    if (!count || !setdev || !meminfo) {
        fprintf(stderr, "vgpu-selftest-probe: %s lacks cudaGetDeviceCount, cudaSetDevice or cudaMemGetInfo\n", path);
        return 1;
    }
    int n = 0, rc = count(&n);
    if (rc == 0) rc = setdev(ordinal);
    size_t fr = 0, tot = 0;
    if (rc == 0) rc = meminfo(&fr, &tot);
    if (rc != 0) {
        fprintf(stderr, "vgpu-selftest-probe: CUDA runtime error %d\n", rc);
        return 1;
    }
    printf("devices=%d total=%zu free=%zu pid=%d\n", n, tot, fr, (int)getpid());
    return 0;
}

static int usage(void) {
    fprintf(stderr,
            "usage: vgpu-selftest-probe env DEV | fill DEV ROUTE CHUNK MAX | spin DEV NS SECONDS | cost DEV N | "
            "cudart LIB DEV | ptx spin | ptx global SIZE\n");
    return 2;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 3) return usage();
    if (!strcmp(argv[1], "cudart") && argc == 4) return cmd_cudart(argv[2], atoi(argv[3]));
    if (!strcmp(argv[1], "ptx") && argc == 3 && !strcmp(argv[2], "spin")) return fputs(SPIN_PTX, stdout) < 0;
    if (!strcmp(argv[1], "ptx") && argc == 4 && !strcmp(argv[2], "global")) {
        char ptx[256];
        global_ptx(ptx, sizeof ptx, (size_t)strtoull(argv[3], NULL, 10));
        return fputs(ptx, stdout) < 0;
    }
    load_cuda();
    int dev = atoi(argv[2]);
    if (!strcmp(argv[1], "env") && argc == 3) return cmd_env(dev);
    if (!strcmp(argv[1], "fill") && argc == 6)
        return cmd_fill(dev, argv[3], (size_t)strtoull(argv[4], NULL, 10), (size_t)strtoull(argv[5], NULL, 10));
    if (!strcmp(argv[1], "spin") && argc == 5) return cmd_spin(dev, strtoull(argv[3], NULL, 10), atof(argv[4]));
    if (!strcmp(argv[1], "cost") && argc == 4) return cmd_cost(dev, atol(argv[3]));
    return usage();
}

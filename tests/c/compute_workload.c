/*
 * A GPU workload for the compute-cap tests and benchmark (on the simulated GPU).
 *
 *   compute_workload [--kernel sim_1000us] [--grid 1] [--path kernel|ptsz|ex|ex_ptsz|coop|coop_ptsz|graph|graph_ptsz]
 *                    [--graph-nodes 10] [--seconds 3] [--warmup 1] [--sync-every 0] [--device 0]
 *                    [--timeline-ms 0] [--threads 1] [--gap-us 0] [--burst 1]
 *
 * Launches kernels back to back (asynchronously, or synchronising every N launches) on one
 * device for --warmup + --seconds, and reports its own share of device time over the measured
 * window. The window starts and ends with a cuCtxSynchronize, so nothing queued crosses its
 * edges. share = the device time the simulator actually served this process in the window
 * (simgpuProcessBusyNs, the simulator's ground truth: complete 50 ms buckets inside the window),
 * as kernel durations vary and neighbours time-slice the device; model_share = launches in the
 * window x modelled kernel time / window (a kernel `sim_<N>us` takes N us per wave of SM-count
 * blocks on average), the only figure available on a driver without that function.
 *
 * --gap-us G --burst N: after every N launches the thread spends G us on the host (busy, as a
 * program preparing its next batch would): spaced launches (N = 1) or batches of N.
 *
 * Output (one line, key=value): share=<percent> model_share=<percent> launches=<n> window_s=<s>
 *   kernel_us=<us> cpu_s=<user+sys CPU of the whole run> total_s=<wall time of the whole run>
 *   busy_run_ns=<device time served to this process over the whole run, simgpuProcessBusyNs>
 *   launches_run=<launches of the whole run> cpu_wait_s=<time the launching threads were runnable
 *   but waiting for a CPU: a share short of its cap is the host's, not the cap's, when it is large>;
 *   first a line start_ns=<CLOCK_MONOTONIC at the start>
 * With --timeline-ms T also lines "tl <t_ms since start> <share percent of that interval>"
 * (launch-time based; the queue ahead is bounded by the shim).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "vgpu/cuda_api.h"

#define CHECK(x)                                                                                                       \
    do {                                                                                                               \
        CUresult r_ = (x);                                                                                             \
        if (r_ != CUDA_SUCCESS) {                                                                                      \
            fprintf(stderr, "workload: %s failed: %d (line %d)\n", #x, (int)r_, __LINE__);                             \
            exit(2);                                                                                                   \
        }                                                                                                              \
    } while (0)

static const char *kname = "sim_1000us";
static const char *path = "kernel";
static unsigned grid = 1;
static int graph_nodes = 10;
static double seconds = 3, warmup = 1;
static int sync_every = 0, device = 0, timeline_ms = 0, nthreads = 1, burst = 1;
static double gap_us = 0;

static CUcontext ctx;
static CUfunction fn;
static double kernel_us;
static CUgraphExec gexec;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

/* Seconds the calling thread has spent runnable, waiting for a CPU (schedstat's second field). */
static double thread_wait_s(void) {
    FILE *f = fopen("/proc/thread-self/schedstat", "r");
    if (!f) return 0;
    unsigned long long run = 0, wait = 0;
    if (fscanf(f, "%llu %llu", &run, &wait) != 2) wait = 0;
    fclose(f);
    return (double)wait / 1e9;
}

static CUresult launch_one(CUstream s, const char *how) {
    if (!strcmp(how, "kernel")) return cuLaunchKernel(fn, grid, 1, 1, 128, 1, 1, 0, s, NULL, NULL);
    if (!strcmp(how, "ptsz")) return cuLaunchKernel_ptsz(fn, grid, 1, 1, 128, 1, 1, 0, s, NULL, NULL);
    if (!strcmp(how, "ex") || !strcmp(how, "ex_ptsz")) {
        CUlaunchConfig c;
        memset(&c, 0, sizeof c);
        c.gridDimX = grid;
        c.gridDimY = c.gridDimZ = 1;
        c.blockDimX = 128;
        c.blockDimY = c.blockDimZ = 1;
        c.hStream = s;
        return !strcmp(how, "ex") ? cuLaunchKernelEx(&c, fn, NULL, NULL) : cuLaunchKernelEx_ptsz(&c, fn, NULL, NULL);
    }
    if (!strcmp(how, "coop")) return cuLaunchCooperativeKernel(fn, grid, 1, 1, 128, 1, 1, 0, s, NULL);
    if (!strcmp(how, "coop_ptsz")) return cuLaunchCooperativeKernel_ptsz(fn, grid, 1, 1, 128, 1, 1, 0, s, NULL);
    if (!strcmp(how, "graph")) return cuGraphLaunch(gexec, s);
    if (!strcmp(how, "graph_ptsz")) return cuGraphLaunch_ptsz(gexec, s);
    fprintf(stderr, "workload: unknown --path %s\n", how);
    exit(2);
}

static int is_ptsz(void) { return strstr(path, "ptsz") != NULL; }

struct worker {
    CUstream stream;
    long launches_window, launches_run;
    long *tl;
    int64_t t_start, t0, t1;
    double waited; /* seconds runnable but not running, over its run */
};

static volatile int phase; /* 0 warmup, 1 window, 2 done */

static void *work(void *arg) {
    struct worker *w = arg;
    CHECK(cuCtxSetCurrent(ctx));
    double wait0 = thread_wait_s();
    long n = 0;
    int64_t end_warm = w->t_start + (int64_t)(warmup * 1e9);
    int64_t end_all = end_warm + (int64_t)(seconds * 1e9);
    int in_window = 0;
    for (;;) {
        int64_t t = now_ns();
        if (!in_window && t >= end_warm) {
            CHECK(cuCtxSynchronize());
            w->t0 = now_ns();
            in_window = 1;
        }
        if (t >= end_all) break;
        CHECK(launch_one(w->stream, path));
        n++;
        if (in_window) w->launches_window++;
        if (w->tl) {
            long slot = (long)((now_ns() - w->t_start) / ((int64_t)timeline_ms * 1000000));
            if (slot >= 0 && slot < 100000) __atomic_fetch_add(&w->tl[slot], 1, __ATOMIC_RELAXED);
        }
        if (sync_every > 0 && n % sync_every == 0)
            CHECK(is_ptsz() ? cuStreamSynchronize_ptsz(w->stream) : cuStreamSynchronize(w->stream));
        if (gap_us > 0 && n % burst == 0) {
            int64_t until = now_ns() + (int64_t)(gap_us * 1000);
            while (now_ns() < until) {}
        }
    }
    w->launches_run = n;
    CHECK(cuCtxSynchronize());
    w->t1 = now_ns();
    w->waited = thread_wait_s() - wait0;
    return NULL;
}

int main(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--kernel"))
            kname = v;
        else if (!strcmp(k, "--grid"))
            grid = (unsigned)atoi(v);
        else if (!strcmp(k, "--path"))
            path = v;
        else if (!strcmp(k, "--graph-nodes"))
            graph_nodes = atoi(v);
        else if (!strcmp(k, "--seconds"))
            seconds = atof(v);
        else if (!strcmp(k, "--warmup"))
            warmup = atof(v);
        else if (!strcmp(k, "--sync-every"))
            sync_every = atoi(v);
        else if (!strcmp(k, "--device"))
            device = atoi(v);
        else if (!strcmp(k, "--timeline-ms"))
            timeline_ms = atoi(v);
        else if (!strcmp(k, "--threads"))
            nthreads = atoi(v);
        else if (!strcmp(k, "--gap-us"))
            gap_us = atof(v);
        else if (!strcmp(k, "--burst"))
            burst = atoi(v) > 0 ? atoi(v) : 1;
        else {
            fprintf(stderr, "workload: unknown option %s\n", k);
            return 2;
        }
    }
    CUresult ir = cuInit(0);
    if (ir != CUDA_SUCCESS) {
        printf("cuInit=%d\n", (int)ir);
        return 3;
    }
    CUdevice dev;
    CHECK(cuDeviceGet(&dev, device));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CUmodule mod;
    CHECK(cuModuleLoadData(&mod, "simgpu-module"));
    CHECK(cuModuleGetFunction(&fn, mod, kname));
    int sms = 1;
    CHECK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    unsigned n_us = 10;
    if (sscanf(kname, "sim_%uus", &n_us) != 1) n_us = 10;
    unsigned waves = (grid + (unsigned)sms - 1) / (unsigned)sms;
    kernel_us = (double)n_us * waves;
    double unit_us = kernel_us;

    CUstream streams[16] = {0};
    if (nthreads < 1 || nthreads > 16) nthreads = 1;
    for (int i = 0; i < nthreads; i++) CHECK(cuStreamCreate(&streams[i], CU_STREAM_NON_BLOCKING));
    if (is_ptsz() && nthreads == 1) streams[0] = NULL; /* the per-thread default stream */

    if (!strncmp(path, "graph", 5)) {
        CUstream cs;
        CHECK(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING));
        CHECK(cuStreamBeginCapture_v2(cs, CU_STREAM_CAPTURE_MODE_GLOBAL));
        for (int i = 0; i < graph_nodes; i++) CHECK(cuLaunchKernel(fn, grid, 1, 1, 128, 1, 1, 0, cs, NULL, NULL));
        CUgraph g;
        CHECK(cuStreamEndCapture(cs, &g));
        CHECK(cuGraphInstantiateWithFlags(&gexec, g, 0));
        unit_us = kernel_us * graph_nodes;
    }

    struct worker ws[16];
    memset(ws, 0, sizeof ws);
    long *tl = NULL;
    if (timeline_ms > 0) tl = calloc(100000, sizeof *tl);
    int64_t start = now_ns();
    printf("start_ns=%lld\n", (long long)start);
    fflush(stdout);
    double c0 = cpu_s();
    pthread_t th[16];
    for (int i = 0; i < nthreads; i++) {
        ws[i].stream = streams[i];
        ws[i].tl = tl;
        ws[i].t_start = start;
        pthread_create(&th[i], NULL, work, &ws[i]);
    }
    long total = 0, total_run = 0;
    double waited = 0;
    int64_t t0 = 0, t1 = 0;
    for (int i = 0; i < nthreads; i++) {
        pthread_join(th[i], NULL);
        total += ws[i].launches_window;
        total_run += ws[i].launches_run;
        waited += ws[i].waited;
        if (!t0 || ws[i].t0 < t0) t0 = ws[i].t0;
        if (ws[i].t1 > t1) t1 = ws[i].t1;
    }
    double c1 = cpu_s();
    double win = (double)(t1 - t0) / 1e9;
    double model_share = 100.0 * (double)total * unit_us / 1e6 / win;
    double share = model_share;
    typedef CUresult (*busy_fn)(CUdevice, unsigned long long, unsigned long long, unsigned long long *,
                                unsigned long long *);
    busy_fn busy = (busy_fn)dlsym(RTLD_DEFAULT, "simgpuProcessBusyNs");
    unsigned long long busy_ns = 0, busy_win = 0;
    if (busy && busy(device, (unsigned long long)t0, (unsigned long long)t1, &busy_ns, &busy_win) == CUDA_SUCCESS &&
        busy_win)
        share = 100.0 * (double)busy_ns / (double)busy_win;
    /* The whole run: every bucket that holds any of it (the process had no device work before
     * its start or after its last synchronisation). */
    unsigned long long busy_run = 0, run_win = 0;
    int64_t t_end = now_ns();
    if (busy)
        busy(device, (unsigned long long)(start - 100000000LL), (unsigned long long)(t_end + 100000000LL), &busy_run,
             &run_win);
    if (tl) {
        long nslots = (long)((warmup + seconds) * 1000 / timeline_ms);
        for (long i = 0; i < nslots; i++)
            printf("tl %ld %.2f\n", i * timeline_ms, 100.0 * (double)tl[i] * unit_us / 1000.0 / timeline_ms);
    }
    double total_s = (double)(now_ns() - start) / 1e9;
    printf("share=%.3f model_share=%.3f launches=%ld window_s=%.4f kernel_us=%.1f unit_us=%.1f cpu_s=%.3f total_s=%.3f "
           "busy_run_ns=%llu launches_run=%ld cpu_wait_s=%.3f\n",
           share, model_share, total, win, kernel_us, unit_us, c1 - c0, total_s, busy_run, total_run, waited);
    return 0;
}

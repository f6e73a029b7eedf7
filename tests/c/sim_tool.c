/*
 * A small CUDA client of the simulator for the multi-process tests (tests/sim/):
 *
 *   sim_tool info                       print "free=<bytes> total=<bytes>" (cuMemGetInfo_v2)
 *   sim_tool hold BYTES                 allocate BYTES, print "READY", wait until stdin closes
 *   sim_tool alloc BYTES                try to allocate: exit 0 on success (printing "free=F total=T"
 *                                       after it), 2 on out-of-memory
 *   sim_tool load US BUSY_MS PERIOD_MS SECONDS
 *                                       launch sim_<US>us kernels: BUSY_MS of device work at the
 *                                       start of every PERIOD_MS (absolute schedule), for SECONDS;
 *                                       BUSY_MS == PERIOD_MS is a back-to-back launch loop
 *   sim_tool fork BYTES                 parent holds BYTES; a forked child allocates BYTES too in
 *                                       a context of its own; prints both pids and free memory
 *   sim_tool forkidle BYTES             parent holds BYTES, forks a child that never touches CUDA
 *                                       and sleeps (up to 120 s); prints "child pid=N" and READY
 *   sim_tool init                       print the cuInit result code
 *   sim_tool launches N                 N launches of sim_0us then a sync; prints ns per launch
 *   sim_tool allocs N                   N cuMemAlloc/cuMemFree pairs of 1 MiB
 */
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sim_common.h"

static CUcontext setup(void) {
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    return ctx;
}

static void wait_stdin_closed(void) {
    char b[64];
    while (read(0, b, sizeof b) > 0) {}
}

static void sleep_until(double t) {
    struct timespec ts = {.tv_sec = (time_t)t, .tv_nsec = (long)((t - (double)(time_t)t) * 1e9)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {}
}

static int load(unsigned us, unsigned busy_ms, unsigned period_ms, double seconds) {
    setup();
    CUmodule m;
    CUfunction f;
    char name[32];
    snprintf(name, sizeof name, "sim_%uus", us);
    CHECK(cuModuleLoadData(&m, "any image"));
    CHECK(cuModuleGetFunction(&f, m, name));
    double start = now_s(), end = start + seconds;
    printf("READY\n");
    fflush(stdout);
    if (busy_ms >= period_ms) {
        while (now_s() < end) /* paced by the simulated pushbuffer */
            CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
    } else {
        unsigned per_period = busy_ms * 1000 / us;
        for (long k = 0;; k++) {
            double t = start + (double)k * period_ms / 1e3;
            if (t >= end) break;
            sleep_until(t);
            for (unsigned i = 0; i < per_period; i++) CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
        }
    }
    CHECK(cuCtxSynchronize());
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) return 64;
    const char *cmd = argv[1];
    if (strcmp(cmd, "init") == 0) {
        printf("%d\n", (int)cuInit(0));
        return 0;
    }
    if (strcmp(cmd, "info") == 0) {
        setup();
        size_t fr, tot;
        CHECK(cuMemGetInfo_v2(&fr, &tot));
        printf("free=%zu total=%zu\n", fr, tot);
        return 0;
    }
    if (strcmp(cmd, "hold") == 0 && argc == 3) {
        setup();
        CUdeviceptr p;
        CHECK(cuMemAlloc_v2(&p, strtoull(argv[2], NULL, 0)));
        printf("READY pid=%d\n", (int)getpid());
        fflush(stdout);
        wait_stdin_closed();
        return 0;
    }
    if (strcmp(cmd, "alloc") == 0 && argc == 3) {
        setup();
        CUdeviceptr p;
        CUresult rc = cuMemAlloc_v2(&p, strtoull(argv[2], NULL, 0));
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) return 2;
        CHECK(rc);
        size_t free_b, total_b;
        CHECK(cuMemGetInfo_v2(&free_b, &total_b));
        printf("free=%zu total=%zu\n", free_b, total_b);
        return 0;
    }
    if (strcmp(cmd, "launches") == 0 && argc == 3) {
        setup();
        CUmodule m;
        CUfunction f;
        CHECK(cuModuleLoadData(&m, "any image"));
        CHECK(cuModuleGetFunction(&f, m, "sim_0us"));
        long n = atol(argv[2]);
        double t0 = now_s();
        for (long i = 0; i < n; i++) CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
        double t1 = now_s();
        CHECK(cuCtxSynchronize());
        printf("ns_per_launch=%.1f\n", (t1 - t0) * 1e9 / (double)n);
        return 0;
    }
    if (strcmp(cmd, "allocs") == 0 && argc == 3) {
        setup();
        long n = atol(argv[2]);
        for (long i = 0; i < n; i++) {
            CUdeviceptr p;
            CHECK(cuMemAlloc_v2(&p, 1 << 20));
            CHECK(cuMemFree_v2(p));
        }
        return 0;
    }
    if (strcmp(cmd, "load") == 0 && argc == 6)
        return load((unsigned)atoi(argv[2]), (unsigned)atoi(argv[3]), (unsigned)atoi(argv[4]), atof(argv[5]));
    if (strcmp(cmd, "forkidle") == 0 && argc == 3) {
        setup();
        CUdeviceptr p;
        CHECK(cuMemAlloc_v2(&p, strtoull(argv[2], NULL, 0)));
        pid_t child = fork();
        if (child < 0) return 1;
        if (child == 0) {
            /* inherits the parent's mappings and descriptors, calls nothing of CUDA */
            for (int i = 0; i < 120; i++) sleep(1);
            _exit(0);
        }
        printf("child pid=%d\n", (int)child);
        printf("READY pid=%d\n", (int)getpid());
        fflush(stdout);
        wait_stdin_closed();
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        return 0;
    }
    if (strcmp(cmd, "fork") == 0 && argc == 3) {
        size_t bytes = strtoull(argv[2], NULL, 0);
        setup();
        CUdeviceptr p;
        CHECK(cuMemAlloc_v2(&p, bytes));
        int fds[2], ready[2];
        if (pipe(fds) != 0 || pipe(ready) != 0) return 1;
        pid_t child = fork();
        if (child == 0) {
            /* the parent's context is not usable here; a new init and context are */
            CUcontext c = NULL;
            EXPECT(cuCtxGetCurrent(&c) == CUDA_ERROR_NOT_INITIALIZED);
            setup();
            CUdeviceptr q;
            CHECK(cuMemAlloc_v2(&q, bytes));
            size_t fr, tot;
            CHECK(cuMemGetInfo_v2(&fr, &tot));
            printf("child pid=%d free=%zu\n", (int)getpid(), fr);
            fflush(stdout);
            close(fds[1]);
            close(ready[0]);
            if (write(ready[1], "r", 1) != 1) /* tell the parent the child is set up */
                _exit(1);
            char b;
            while (read(fds[0], &b, 1) > 0) {}
            _exit(0);
        }
        close(fds[0]);
        close(ready[1]);
        char r;
        if (read(ready[0], &r, 1) != 1) return 1;
        printf("parent pid=%d child=%d\n", (int)getpid(), (int)child);
        printf("READY\n");
        fflush(stdout);
        wait_stdin_closed();
        close(fds[1]);
        int st;
        waitpid(child, &st, 0);
        return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    }
    return 64;
}

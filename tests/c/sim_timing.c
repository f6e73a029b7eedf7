/* Kernel-duration distribution and time-slicing of the simulated device (tests/sim/test_timing.py).
 *
 *   sim_timing durations NAME N    launch N kernels NAME back to back on one stream with an event
 *                                  between each two; print each kernel's duration (us), one a line
 *   sim_timing long US FIFO        launch one sim_<US>us kernel, write "launched" to the pipe FIFO,
 *                                  synchronise; print JSON: the kernel's event time, the wall time
 *                                  from launch to the return of cuStreamSynchronize, and what
 *                                  cuStreamQuery answered halfway
 *   sim_timing short US FIFO       wait for "launched" on FIFO, sleep 2 ms, launch one sim_<US>us
 *                                  kernel; print JSON: the time between events recorded before and
 *                                  after it, and the wall time from the launch to the return of
 *                                  cuEventSynchronize
 */
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "sim_common.h"

static double wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static CUfunction setup(const char *name) {
    CUdevice dev;
    CUcontext ctx;
    CUmodule m;
    CUfunction f;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate_v2(&ctx, 0, dev));
    CHECK(cuModuleLoadData(&m, "x"));
    CHECK(cuModuleGetFunction(&f, m, name));
    return f;
}

static int durations(const char *name, int n) {
    CUfunction f = setup(name);
    CUevent *ev = calloc((size_t)n + 1, sizeof *ev);
    EXPECT(ev != NULL);
    for (int i = 0; i <= n; i++) CHECK(cuEventCreate(&ev[i], 0));
    /* the first event waits for a 100 ms kernel: every later one sits between queued kernels
     * (with a deep queue, SIMGPU_QUEUE_AHEAD_US, the host may be descheduled for a while) */
    CUfunction warm;
    CUmodule m;
    CHECK(cuModuleLoadData(&m, "y"));
    CHECK(cuModuleGetFunction(&warm, m, "sim_100000us"));
    CHECK(cuLaunchKernel(warm, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CHECK(cuEventRecord(ev[0], NULL));
    for (int i = 0; i < n; i++) {
        CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
        CHECK(cuEventRecord(ev[i + 1], NULL));
    }
    CHECK(cuCtxSynchronize());
    for (int i = 0; i < n; i++) {
        float ms;
        CHECK(cuEventElapsedTime_v2(&ms, ev[i], ev[i + 1]));
        printf("%.3f\n", (double)ms * 1000.0);
    }
    return 0;
}

/* A context with function sim_<us>us, and two timing events. */
static CUfunction setup_us(int us, CUevent *a, CUevent *b) {
    char name[64];
    snprintf(name, sizeof name, "sim_%dus", us);
    CUfunction f = setup(name);
    CHECK(cuEventCreate(a, 0));
    CHECK(cuEventCreate(b, 0));
    return f;
}

static int long_kernel(int us, const char *fifo) {
    CUevent a, b;
    CUfunction f = setup_us(us, &a, &b);
    CHECK(cuEventRecord(a, NULL));
    double t0 = wall_ms();
    CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CHECK(cuEventRecord(b, NULL));
    int fd = open(fifo, O_WRONLY);
    EXPECT(fd >= 0);
    EXPECT(write(fd, "launched\n", 9) == 9);
    close(fd);
    struct timespec half = {0, (long)us * 500L};
    nanosleep(&half, NULL);
    CUresult q = cuStreamQuery(NULL);
    CHECK(cuStreamSynchronize(NULL));
    double wall = wall_ms() - t0;
    float ms;
    CHECK(cuEventElapsedTime_v2(&ms, a, b));
    printf("{\"event_ms\": %.4f, \"wall_ms\": %.4f, \"query_halfway\": %d}\n", (double)ms, wall, (int)q);
    return 0;
}

static int short_kernel(int us, const char *fifo) {
    CUevent a, b;
    CUfunction f = setup_us(us, &a, &b);
    int fd = open(fifo, O_RDONLY);
    EXPECT(fd >= 0);
    char buf[16];
    EXPECT(read(fd, buf, sizeof buf) > 0);
    close(fd);
    struct timespec two = {0, 2000000L};
    nanosleep(&two, NULL);
    CHECK(cuEventRecord(a, NULL));
    double t0 = wall_ms();
    CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CHECK(cuEventRecord(b, NULL));
    CHECK(cuEventSynchronize(b));
    double wall = wall_ms() - t0;
    float ms;
    CHECK(cuEventElapsedTime_v2(&ms, a, b));
    printf("{\"event_ms\": %.4f, \"wall_ms\": %.4f}\n", (double)ms, wall);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "durations") == 0) return durations(argv[2], atoi(argv[3]));
    if (argc == 4 && strcmp(argv[1], "long") == 0) return long_kernel(atoi(argv[2]), argv[3]);
    if (argc == 4 && strcmp(argv[1], "short") == 0) return short_kernel(atoi(argv[2]), argv[3]);
    fprintf(stderr, "usage: sim_timing durations NAME N | long US FIFO | short US FIFO\n");
    return 2;
}

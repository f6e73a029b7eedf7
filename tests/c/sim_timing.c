/* Kernel-duration distribution and time-slicing of the simulated device (tests/sim/test_timing.py).
 *
 *   sim_timing durations NAME N    launch N kernels NAME back to back on one stream with an event
 *                                  between each two; print each kernel's duration (us), one a line
 *   sim_timing long US WARM FIFO   launch a sim_<WARM>us kernel, record an event, launch one
 *                                  sim_<US>us kernel, record an event; once the first event is
 *                                  done (the long kernel has the device) write "launched" to the
 *                                  pipe FIFO; synchronise; print JSON: the long kernel's event
 *                                  time, the wall time from its launch to the return of
 *                                  cuStreamSynchronize, and what cuStreamQuery answered halfway
 *   sim_timing short US WARM FIFO  wait for "launched" on FIFO, sleep 2 ms, launch a sim_<WARM>us
 *                                  kernel (none if WARM is 0), record an event, launch one
 *                                  sim_<US>us kernel, record an event; print JSON: the time between
 *                                  the two events, and the wall time from the launch to the
 *                                  return of cuEventSynchronize
 *
 * The warm-up kernels make the timing events exact whatever the host does: an event recorded
 * behind queued work completes when that work does, so the host may be descheduled for up to
 * the warm-up's length between the event and the launch it brackets without the gap showing.
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

/* Function `name` of a module of its own (the simulator models a kernel by its name). */
static CUfunction function(const char *name) {
    CUmodule m;
    CUfunction f;
    CHECK(cuModuleLoadData(&m, "x"));
    CHECK(cuModuleGetFunction(&f, m, name));
    return f;
}

static CUfunction function_us(int us) {
    char name[64];
    snprintf(name, sizeof name, "sim_%dus", us);
    return function(name);
}

/* A context on device 0, current from now on. */
static void make_context(void) {
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate_v2(&ctx, 0, dev));
}

static int durations(const char *name, int n) {
    make_context();
    CUfunction f = function(name);
    CUevent *ev = calloc((size_t)n + 1, sizeof *ev);
    EXPECT(ev != NULL);
    for (int i = 0; i <= n; i++) CHECK(cuEventCreate(&ev[i], 0));
    /* the first event waits for a 100 ms kernel: every later one sits between queued kernels
     * (with a deep queue, SIMGPU_QUEUE_AHEAD_US, the host may be descheduled for a while) */
    CHECK(cuLaunchKernel(function_us(100000), 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
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

static void launch(CUfunction f) { CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)); }

/* A context with function sim_<us>us, the warm-up sim_<warm>us (NULL if 0), two timing events. */
static CUfunction setup_us(int us, int warm, CUfunction *w, CUevent *a, CUevent *b) {
    make_context();
    CUfunction f = function_us(us);
    *w = warm > 0 ? function_us(warm) : NULL;
    CHECK(cuEventCreate(a, 0));
    CHECK(cuEventCreate(b, 0));
    return f;
}

static int long_kernel(int us, int warm, const char *fifo) {
    CUevent a, b;
    CUfunction w, f = setup_us(us, warm, &w, &a, &b);
    if (w) launch(w);
    CHECK(cuEventRecord(a, NULL));
    double t0 = wall_ms();
    launch(f);
    CHECK(cuEventRecord(b, NULL));
    CHECK(cuEventSynchronize(a)); /* the long kernel has started: the other process may launch */
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

static int short_kernel(int us, int warm, const char *fifo) {
    CUevent a, b;
    CUfunction w, f = setup_us(us, warm, &w, &a, &b);
    int fd = open(fifo, O_RDONLY);
    EXPECT(fd >= 0);
    char buf[16];
    EXPECT(read(fd, buf, sizeof buf) > 0);
    close(fd);
    struct timespec two = {0, 2000000L};
    nanosleep(&two, NULL);
    if (w) launch(w);
    CHECK(cuEventRecord(a, NULL));
    double t0 = wall_ms();
    launch(f);
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
    if (argc == 5 && strcmp(argv[1], "long") == 0) return long_kernel(atoi(argv[2]), atoi(argv[3]), argv[4]);
    if (argc == 5 && strcmp(argv[1], "short") == 0) return short_kernel(atoi(argv[2]), atoi(argv[3]), argv[4]);
    fprintf(stderr, "usage: sim_timing durations NAME N | long US WARM FIFO | short US WARM FIFO\n");
    return 2;
}

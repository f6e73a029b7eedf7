/*
 * A borrower in a bursting slice (tests/driver/test_burst_reclaim.py; docs/policy.md, "Taking it
 * back"). It allocates up to N chunks of CHUNK bytes with cuMemAlloc_v2 (stopping at the first
 * refusal), prints "held <count>" and then, by MODE:
 *
 *   polite  on SIGWINCH (the plugin's notice) frees chunks down to KEEP, prints "freed <count>"
 *   deaf    never frees: SIGWINCH keeps its default action (ignored), so it is stopped
 *   storm   four threads allocate and free CHUNK-sized blocks as fast as they can on top of what
 *           it holds (a cudaMalloc storm); on SIGWINCH the storm stops and it frees down to KEEP,
 *           prints "freed <count>"
 *   greedy  until stdin closes: allocates chunks up to N whenever it can, frees nothing of its own
 *           accord (a refusal only makes it try again), and on every SIGWINCH frees down to KEEP
 *           and goes on
 *
 * Then it waits until stdin closes (or it is killed) and exits 0.
 *
 *   burst_borrower polite|deaf|storm|greedy CHUNK N KEEP
 */
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vgpu/cuda_api.h"

static volatile sig_atomic_t noticed;
static volatile int storming = 1;
static CUcontext ctx;
static unsigned long long chunk;

static void on_winch(int sig) {
    (void)sig;
    noticed = 1;
}

static void *storm(void *arg) {
    (void)arg;
    cuCtxSetCurrent(ctx);
    while (storming) {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, chunk) == CUDA_SUCCESS) cuMemFree_v2(p);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: burst_borrower polite|deaf|storm CHUNK N KEEP\n");
        return 2;
    }
    const char *mode = argv[1];
    chunk = strtoull(argv[2], NULL, 10);
    int n = atoi(argv[3]), keep = atoi(argv[4]);
    CUdevice dev;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
        cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        fprintf(stderr, "CUDA setup failed\n");
        return 2;
    }
    sigset_t winch, orig;
    sigemptyset(&winch);
    sigaddset(&winch, SIGWINCH);
    if (strcmp(mode, "deaf") != 0) {
        signal(SIGWINCH, on_winch);
        /* blocked until sigsuspend below (and in the storm threads for good): no lost notice */
        pthread_sigmask(SIG_BLOCK, &winch, &orig);
    }
    CUdeviceptr *held = calloc((size_t)n, sizeof *held);
    int count = 0;
    while (count < n && cuMemAlloc_v2(&held[count], chunk) == CUDA_SUCCESS) count++;
    pthread_t threads[4];
    int nthreads = 0;
    if (strcmp(mode, "storm") == 0)
        for (; nthreads < 4; nthreads++) pthread_create(&threads[nthreads], NULL, storm, NULL);
    printf("held %d\n", count);
    fflush(stdout);
    if (strcmp(mode, "greedy") == 0) {
        pthread_sigmask(SIG_UNBLOCK, &winch, NULL);
        struct pollfd pfd = {.fd = 0, .events = POLLIN};
        while (poll(&pfd, 1, 0) == 0) {
            if (noticed) {
                noticed = 0;
                while (count > keep) cuMemFree_v2(held[--count]);
            }
            if (count < n && cuMemAlloc_v2(&held[count], chunk) == CUDA_SUCCESS)
                count++;
            else
                usleep(200);
        }
        return 0;
    }
    if (strcmp(mode, "deaf") != 0) {
        while (!noticed) sigsuspend(&orig);
        storming = 0;
        for (int i = 0; i < nthreads; i++) pthread_join(threads[i], NULL);
        while (count > keep) cuMemFree_v2(held[--count]);
        printf("freed %d\n", count);
        fflush(stdout);
    }
    char buf[64];
    while (read(0, buf, sizeof buf) > 0) {}
    return 0;
}

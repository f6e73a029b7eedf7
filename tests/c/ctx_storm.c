/*
 * Many threads of one process create contexts on device 0 at the same instant, as a program
 * whose worker threads each bring CUDA up does: argv[1] threads; thread i retains the primary
 * context when argv[2] is "primary", creates its own (cuCtxCreate_v2) when "create", and
 * alternates (even: primary, odd: create) when "mixed". The threads start together (a barrier
 * after cuInit). Prints "rc=<r0>,<r1>,..." (CUresult per thread), then "ready", and keeps what it
 * made until its stdin closes.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu/cuda_api.h"

#define MAX_THREADS 64

static pthread_barrier_t start;
static const char *mode;
static CUresult results[MAX_THREADS];

static void *worker(void *arg) {
    int i = (int)(long)arg;
    CUcontext ctx = NULL;
    int primary = !strcmp(mode, "primary") || (!strcmp(mode, "mixed") && i % 2 == 0);
    pthread_barrier_wait(&start);
    results[i] = primary ? cuDevicePrimaryCtxRetain(&ctx, 0) : cuCtxCreate_v2(&ctx, 0, 0);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: ctx_storm THREADS primary|create|mixed\n");
        return 2;
    }
    int n = atoi(argv[1]);
    mode = argv[2];
    if (n < 1 || n > MAX_THREADS) return 2;
    CUresult rc = cuInit(0);
    if (rc != CUDA_SUCCESS) {
        printf("rc=init:%d\nready\n", (int)rc);
        fflush(stdout);
        return 1;
    }
    pthread_t t[MAX_THREADS];
    pthread_barrier_init(&start, NULL, (unsigned)n);
    for (int i = 0; i < n; i++) pthread_create(&t[i], NULL, worker, (void *)(long)i);
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    printf("rc=");
    for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", (int)results[i]);
    printf("\nready\n");
    fflush(stdout);
    char buf[64];
    while (fread(buf, 1, sizeof buf, stdin) > 0) {}
    return 0;
}

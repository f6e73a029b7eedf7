/*
 * Runs inside a container started with a claim's CDI device (tests/driver/test_e2e_podman.py).
 * It sees only what the CDI spec gave it: CUDA_VISIBLE_DEVICES, the limits and the shim.
 *
 *   e2e_claim_quota info                   print "total=<bytes> free=<bytes>" of device 0, then
 *                                          "nvml=<0|1>": whether NVML is loaded in the process
 *                                          (nothing here asks it: only the shim could have)
 *   e2e_claim_quota alloc <bytes>          try cuMemAlloc_v2; print "alloc=<CUresult>"; exit 0
 *   e2e_claim_quota hold <bytes> <dir>     allocate, create <dir>/held, wait for <dir>/release
 *                                          (at most 60 s), free, exit 0; exit 3 if the
 *                                          allocation failed
 * Exit 2 on a CUDA setup failure, with the call and its result on stderr.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vgpu/cuda_api.h"

#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        CUresult rc_ = (call);                                                                                         \
        if (rc_ != CUDA_SUCCESS) {                                                                                     \
            fprintf(stderr, "%s failed: %d\n", #call, (int)rc_);                                                       \
            return 2;                                                                                                  \
        }                                                                                                              \
    } while (0)

static int setup(void) {
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    return 0;
}

static int touch(const char *dir, const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (f == NULL) return -1;
    fclose(f);
    return 0;
}

static int exists(const char *dir, const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return access(path, F_OK) == 0;
}

/* Whether libnvidia-ml.so.1 is mapped into this process. */
static int nvml_loaded(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[1024];
    int found = 0;
    if (f == NULL) return -1;
    while (!found && fgets(line, sizeof line, f) != NULL) found = strstr(line, "libnvidia-ml.so") != NULL;
    fclose(f);
    return found;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s info | alloc <bytes> | hold <bytes> <dir>\n", argv[0]);
        return 64;
    }
    int rc = setup();
    if (rc != 0) return rc;
    if (strcmp(argv[1], "info") == 0) {
        size_t free_b = 0, total_b = 0;
        CHECK(cuMemGetInfo_v2(&free_b, &total_b));
        printf("total=%zu free=%zu\n", total_b, free_b);
        printf("nvml=%d\n", nvml_loaded());
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "alloc") == 0) {
        CUdeviceptr p = 0;
        CUresult r = cuMemAlloc_v2(&p, strtoull(argv[2], NULL, 10));
        printf("alloc=%d\n", (int)r);
        if (r == CUDA_SUCCESS) cuMemFree_v2(p);
        return 0;
    }
    if (argc >= 4 && strcmp(argv[1], "hold") == 0) {
        CUdeviceptr p = 0;
        CUresult r = cuMemAlloc_v2(&p, strtoull(argv[2], NULL, 10));
        printf("alloc=%d\n", (int)r);
        fflush(stdout);
        if (r != CUDA_SUCCESS) return 3;
        if (touch(argv[3], "held") != 0) {
            perror("create held marker");
            return 2;
        }
        for (int i = 0; i < 600 && !exists(argv[3], "release"); i++) usleep(100000);
        cuMemFree_v2(p);
        return 0;
    }
    fprintf(stderr, "unknown command %s\n", argv[1]);
    return 64;
}

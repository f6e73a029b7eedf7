/*
 * Drives tests/c/bypass_lib.c (tests/shim/test_bypass.py): an ordinary CUDA program (bound to
 * the driver directly, so the shim preloaded before it sees its calls) that loads the hostile
 * library with dlopen after the shim and runs one operation per argument through it:
 *
 *   LIB                 argv[1]: path of the hostile library to dlopen, or "preloaded" when it
 *                       is already loaded (LD_PRELOAD after the shim, or linked)
 *   alloc:N:ROUTE       cuInit, a primary context and cuMemAlloc_v2 of N bytes, every function
 *                       obtained through ROUTE (see bypass_lib.c): rc=
 *   info:ROUTE          cuMemGetInfo_v2 through ROUTE: rc= free= total=
 *   nvml:ROUTE          nvmlDeviceGetMemoryInfo of device 0 through ROUTE: rc= total=
 *   hook:ROUTE:NAME     shim=1 if ROUTE's answer for NAME is the function the program itself binds
 *                       to (the shim's hook when the shim is loaded), found=1 if there is one
 * ROUTE may contain ':' (dlmopen_dep:PATH), so N comes first in alloc.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu/cuda_api.h"
#include "vgpu/nvml_api.h"

typedef void *(*resolve_fn)(const char *route, const char *name);

/* The whole of an allocation through one route: cuInit, a context, cuMemAlloc_v2 (a driver
 * copy in another namespace needs its own initialisation). -1: the route has no such function. */
static int route_alloc(resolve_fn resolve, const char *route, size_t n) {
    CUresult (*init)(unsigned) = (CUresult (*)(unsigned))resolve(route, "cuInit");
    CUresult (*get)(CUdevice *, int) = (CUresult (*)(CUdevice *, int))resolve(route, "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) =
        (CUresult (*)(CUcontext *, CUdevice))resolve(route, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult (*)(CUcontext))resolve(route, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult (*)(CUdeviceptr *, size_t))resolve(route, "cuMemAlloc_v2");
    if (!init || !get || !retain || !set || !alloc) return -1;
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr p;
    CUresult rc = init(0);
    if (rc == CUDA_SUCCESS) rc = get(&dev, 0);
    if (rc == CUDA_SUCCESS) rc = retain(&ctx, dev);
    if (rc == CUDA_SUCCESS) rc = set(ctx);
    if (rc == CUDA_SUCCESS) rc = alloc(&p, n);
    return (int)rc;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) return 2;
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        printf("init failed\n");
        return 1;
    }
    resolve_fn resolve = NULL;
    if (!strcmp(argv[1], "preloaded")) {
        resolve = (resolve_fn)dlsym(RTLD_DEFAULT, "bypass_resolve");
    } else {
        void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
        if (lib) resolve = (resolve_fn)dlsym(lib, "bypass_resolve");
    }
    if (resolve == NULL) {
        printf("cannot load %s: %s\n", argv[1], dlerror());
        return 1;
    }
    for (int i = 2; i < argc; i++) {
        char *op = argv[i], *route = strchr(op, ':');
        if (route == NULL) return 2;
        *route++ = '\0';
        if (!strcmp(op, "alloc")) {
            char *end;
            size_t n = strtoull(route, &end, 0);
            printf("op=alloc route=%s rc=%d\n", end + 1, route_alloc(resolve, end + 1, n));
        } else if (!strcmp(op, "info")) {
            CUresult (*fn)(size_t *, size_t *) = (CUresult (*)(size_t *, size_t *))resolve(route, "cuMemGetInfo_v2");
            size_t free_b = 0, total = 0;
            int rc = fn ? (int)fn(&free_b, &total) : -1;
            printf("op=info route=%s rc=%d free=%zu total=%zu\n", route, rc, free_b, total);
        } else if (!strcmp(op, "nvml")) {
            nvmlReturn_t (*init)(void) = (nvmlReturn_t (*)(void))resolve(route, "nvmlInit_v2");
            nvmlReturn_t (*get)(unsigned, nvmlDevice_t *) =
                (nvmlReturn_t (*)(unsigned, nvmlDevice_t *))resolve(route, "nvmlDeviceGetHandleByIndex_v2");
            nvmlReturn_t (*mem)(nvmlDevice_t, nvmlMemory_t *) =
                (nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t *))resolve(route, "nvmlDeviceGetMemoryInfo");
            nvmlDevice_t d;
            nvmlMemory_t m = {0};
            int rc = -1;
            if (init && get && mem && (rc = (int)init()) == 0 && (rc = (int)get(0, &d)) == 0) rc = (int)mem(d, &m);
            printf("op=nvml route=%s rc=%d total=%llu\n", route, rc, m.total);
        } else if (!strcmp(op, "hook")) {
            char *name = strrchr(route, ':');
            if (name == NULL) return 2;
            *name++ = '\0';
            void *fn = resolve(route, name);
            printf("op=hook route=%s name=%s found=%d shim=%d\n", route, name, fn != NULL,
                   fn != NULL && fn == dlsym(RTLD_DEFAULT, name));
        } else {
            printf("unknown op %s\n", op);
            return 2;
        }
    }
    return 0;
}

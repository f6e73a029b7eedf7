/* A CUDA client that bypasses an LD_PRELOAD / ld.so.preload interposer: it loads libcuda.so.1
 * with dlmopen(LM_ID_NEWLM), into a new link-map namespace, where preloaded libraries are not
 * loaded and cannot interpose. Real-world escape route of "hooks in the process" designs; the
 * watchdog (sharing/watchdog.py) must catch it from outside.
 *
 *   bypass_dlmopen BYTES [DEVICE]   allocate BYTES on DEVICE (default 0), print "held rc=<rc>",
 *                                   then wait for a signal (SIGTERM ends it)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s BYTES [DEVICE]\n", argv[0]);
        return 2;
    }
    unsigned long long bytes = strtoull(argv[1], NULL, 0);
    int ordinal = argc > 2 ? atoi(argv[2]) : 0;
    void *cuda = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cuda) {
        fprintf(stderr, "dlmopen: %s\n", dlerror());
        return 1;
    }
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(cuda, "cuInit");
    CUresult (*dev_get)(CUdevice *, int) = (CUresult(*)(CUdevice *, int))dlsym(cuda, "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) =
        (CUresult(*)(CUcontext *, CUdevice))dlsym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*set_current)(CUcontext) = (CUresult(*)(CUcontext))dlsym(cuda, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) =
        (CUresult(*)(CUdeviceptr *, size_t))dlsym(cuda, "cuMemAlloc_v2");
    if (!init || !dev_get || !retain || !set_current || !alloc) {
        fprintf(stderr, "libcuda.so.1 lacks a driver function\n");
        return 1;
    }
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr p = 0;
    CUresult rc = init(0);
    if (rc == 0) rc = dev_get(&dev, ordinal);
    if (rc == 0) rc = retain(&ctx, dev);
    if (rc == 0) rc = set_current(ctx);
    if (rc == 0) rc = alloc(&p, (size_t)bytes);
    printf("held rc=%d\n", rc);
    fflush(stdout);
    if (rc != 0) return 1;
    for (;;) pause(); /* until a signal ends it; the driver frees its memory at exit */
}

/* A CUDA client that bypasses an LD_PRELOAD / ld.so.preload interposer the way the shim cannot
 * close (docs/shim.md, "Threat model"): it copies the driver library under another name and
 * loads the copy, a second driver instance whose functions the shim never hooked. The watchdog
 * (sharing/observe/watchdog.py) must catch it from outside, through the driver's own per-process figures.
 *
 *   bypass_copy BYTES [DEVICE]   allocate BYTES on DEVICE (default 0), print "held rc=<rc>",
 *                                then wait for a signal (SIGTERM ends it)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

/* Copy the file of the loaded driver to a private temporary name; that path, or NULL. */
static char *copy_driver(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    struct link_map *lm = NULL;
    if (!h || dlinfo(h, RTLD_DI_LINKMAP, &lm) != 0 || !lm || !lm->l_name) return NULL;
    static char dst[] = "/tmp/bypass-driver-XXXXXX";
    int out = mkstemp(dst);
    int in = open(lm->l_name, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (out < 0 || in < 0 || fstat(in, &st) != 0 || sendfile(out, in, NULL, (size_t)st.st_size) != st.st_size)
        return NULL;
    close(in);
    close(out);
    return dst;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s BYTES [DEVICE]\n", argv[0]);
        return 2;
    }
    unsigned long long bytes = strtoull(argv[1], NULL, 0);
    int ordinal = argc > 2 ? atoi(argv[2]) : 0;
    char *copy = copy_driver();
    void *cuda = copy ? dlopen(copy, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (copy) unlink(copy); /* mapped: the file is no longer needed */
    if (!cuda) {
        fprintf(stderr, "cannot load a copy of libcuda.so.1: %s\n", copy ? dlerror() : "copy failed");
        return 1;
    }
    CUresult (*init)(unsigned) = (CUresult (*)(unsigned))dlsym(cuda, "cuInit");
    CUresult (*dev_get)(CUdevice *, int) = (CUresult (*)(CUdevice *, int))dlsym(cuda, "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) =
        (CUresult (*)(CUcontext *, CUdevice))dlsym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*set_current)(CUcontext) = (CUresult (*)(CUcontext))dlsym(cuda, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult (*)(CUdeviceptr *, size_t))dlsym(cuda, "cuMemAlloc_v2");
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

/*
 * A driver whose constructor looks its own entry points up by name (tests/shim/test_bypass.py):
 * built as a stand-in libcuda.so.1, it is loaded by the shim's own resolution (dlopen inside
 * pthread_once), so those lookups reach the shim's dlsym while that resolution is under way.
 * They must be answered, not wait for the resolution they run in. Built with -DMAIN: the
 * program, which calls cuInit through the shim and prints what the constructor saw.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

#ifndef MAIN
int ctor_seen_next, ctor_seen_default;

__attribute__((constructor)) static void look_up_own_names(void) {
    ctor_seen_next = dlsym(RTLD_NEXT, "cuMemAlloc_v2") != NULL;
    ctor_seen_default = dlsym(RTLD_DEFAULT, "cuMemFree_v2") != NULL;
}

int cuInit(unsigned flags) { return (int)flags; }
int cuMemAlloc_v2(void *p, unsigned long n) { return (void)p, (void)n, 0; }
int cuMemFree_v2(void *p) { return (void)p, 0; }
#else
int main(void) {
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(RTLD_DEFAULT, "cuInit");
    int rc = init ? init(0) : -1;
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    int *next = drv ? dlsym(drv, "ctor_seen_next") : NULL, *dflt = drv ? dlsym(drv, "ctor_seen_default") : NULL;
    printf("rc=%d next=%d default=%d\n", rc, next ? *next : -1, dflt ? *dflt : -1);
    return 0;
}
#endif

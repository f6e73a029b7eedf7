/*
 * shim/src/compat.c on its own (tests/shim/test_compat.py), built as the shim is (glibc_compat.h
 * force-included): the rounding that replaces libm agrees with libm's; the weak references to
 * the moved dl* and pthread_* functions are bound where the C library has them; the fallback that
 * reads a loaded object's own symbol table finds the same definitions the dynamic linker does.
 * Prints what it checked, one line each, and exits 0, or names the first disagreement and exits 1.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>

#include "compat.h"

/* libm's own, for comparison (<math.h> declared them under the compat names) */
#undef lround
#undef llroundf
extern long lround(double);
extern long long llroundf(float);

static int ran;
static void once_routine(void) { ran++; }

int main(void) {
    static const double cases[] = {0,
                                   0.5,
                                   -0.5,
                                   1.5,
                                   -1.5,
                                   2.5,
                                   -2.5,
                                   0.49999999999999994,
                                   -0.49999999999999994,
                                   1e15 + 0.5,
                                   4503599627370497.0,
                                   123456.4999,
                                   -7.5,
                                   9.2e18,
                                   -9.2e18,
                                   1e300,
                                   -1e300};
    unsigned agree = 0;
    for (unsigned i = 0; i < sizeof cases / sizeof cases[0]; i++, agree++) {
        double x = cases[i];
        if (vgpu_compat_lround(x) != lround(x))
            return printf("lround(%.17g): %ld, libm %ld\n", x, vgpu_compat_lround(x), lround(x)), 1;
        float f = (float)x;
        if (vgpu_compat_llroundf(f) != llroundf(f)) return printf("llroundf(%.9g) differs\n", f), 1;
    }
    for (double x = -300; x < 300; x += 0.0625, agree++)
        if (vgpu_compat_lround(x) != lround(x)) return printf("lround(%g) differs\n", x), 1;
    printf("rounding: %u values as libm\n", agree);
    pthread_once_t o = PTHREAD_ONCE_INIT;
    vgpu_compat_pthread_once(&o, once_routine);
    vgpu_compat_pthread_once(&o, once_routine);
    printf("pthread_once: ran %d time\n", ran);
    printf("dlopen(libc.so.6, RTLD_NOLOAD): %s\n",
           vgpu_compat_dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD) ? "loaded" : "NULL");
    /* the loaded-object lookup (what an old glibc without libdl at start uses) */
    void *mine = vgpu_compat_dl_sym("dlsym", VGPU_GLIBC_BASE);
    void *theirs = dlvsym(RTLD_DEFAULT, "dlsym", VGPU_GLIBC_BASE);
    if (mine == NULL || mine != theirs)
        return printf("dlsym@%s: %p, dynamic linker %p\n", VGPU_GLIBC_BASE, mine, theirs), 1;
    printf("dlsym@%s: as the dynamic linker\n", VGPU_GLIBC_BASE);
    return 0;
}

/* Preloaded before the shim: a C library whose dlvsym finds nothing, so the shim cannot resolve
 * the real dlsym (as on a glibc whose dlsym has a version the shim does not know). The shim must
 * fail closed with one line, never crash (tests/shim/test_glibc_bound.py). */
#include <stddef.h>

void *dlvsym(void *handle, const char *symbol, const char *version) {
    (void)handle;
    (void)symbol;
    (void)version;
    return NULL;
}

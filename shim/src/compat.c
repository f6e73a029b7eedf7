/*
 * The dl* and pthread_* calls that lived in libdl.so.2 and libpthread.so.0 before glibc 2.34
 * (glibc_compat.h renames every call of them to vgpu_compat_<name>), without either library in
 * the shim's DT_NEEDED: each object there is mapped into every process of the container, while
 * these calls are made only by processes that use CUDA.
 *
 * Each call goes, in order, to:
 *   1. a weak reference to the pinned version (glibc_compat.h): bound at load by the C library
 *      on 2.34+ (where these are compatibility symbols of libc.so.6), or on an older glibc by
 *      libdl/libpthread when the process loaded them at start (a program linked with them, or
 *      with the driver, which needs both);
 *   2. otherwise the same version found in an object already loaded (a library the process
 *      loaded later, e.g. libpthread as the driver's dependency), from its own symbol table;
 *   3. otherwise its library loaded once (libdl through the old C library's own loader entry,
 *      libpthread through dlopen), then 2 again.
 * If all fail (no such library in the image) the call fails with ENOSYS / NULL, and one line says
 * so; pthread_once then runs its routine on the first call (no thread can exist without the
 * library that creates them).
 */
/* Only with glibc_compat.h, which the shim's build force-includes (the test harness, linked
 * with libdl and libpthread directly, has neither the header nor this layer). */
#ifdef VGPU_GLIBC_BASE
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>

#include "elfsym.h"
#include "compat.h"
#include "log.h"

enum { LIB_DL, LIB_PTHREAD };
static const char *const lib_names[] = {"libdl.so.2", "libpthread.so.0"};

struct find_sym {
    const char *name, *version;
    void *addr;
};

static int find_sym_step(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct find_sym *f = data;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type != PT_DYNAMIC) continue;
        struct vgpu_elf e;
        const ElfW(Dyn) *dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
        if (vgpu_elf_open(&e, info->dlpi_addr, dyn) == 0 &&
            vgpu_elf_find(&e, f->name, f->version, VGPU_ELF_DLVSYM, &f->addr) == VGPU_ELF_FOUND)
            return 1;
        f->addr = NULL;
        return 0;
    }
    return 0;
}

/* name@version as defined by a loaded object (exactly that version), or NULL. */
static void *loaded_sym(const char *name, const char *version) {
    struct find_sym f = {name, version, NULL};
    dl_iterate_phdr(find_sym_step, &f);
    return f.addr;
}

static void report_missing(const char *name) {
    static atomic_int reported;
    if (atomic_exchange(&reported, 1)) return;
    vgpu_log(VGPU_LOG_ERROR, "%s: not in the C library, and libdl.so.2 / libpthread.so.0 cannot be loaded", name);
}

static atomic_int libdl_loaded_here;

/* Load `lib` once (its symbols are then found by loaded_sym). */
static void load_lib(int lib) {
    static atomic_int tried[2];
    if (atomic_exchange(&tried[lib], 1)) return;
    if (lib == LIB_PTHREAD) {
        (void)vgpu_compat_dlopen(lib_names[lib], RTLD_NOW);
        return;
    }
    /* libdl itself: through the old C library's internal loader entry (GLIBC_PRIVATE, glibc
     * <= 2.33, the one NSS and iconv use), from its own symbol table: no reference to it */
    void *(*libc_dlopen)(const char *, int) =
        (void *(*)(const char *, int))loaded_sym("__libc_dlopen_mode", "GLIBC_PRIVATE");
    if (libc_dlopen != NULL && libc_dlopen(lib_names[lib], RTLD_NOW) != NULL) atomic_store(&libdl_loaded_here, 1);
}

static void *resolve(int lib, const char *name, const char *version) {
    void *f = loaded_sym(name, version);
    if (f == NULL) {
        load_lib(lib);
        f = loaded_sym(name, version);
    }
    if (f == NULL) report_missing(name);
    return f;
}

void *vgpu_compat_dl_sym(const char *name, const char *version) { return resolve(LIB_DL, name, version); }

int vgpu_compat_libdl_loaded_here(void) { return atomic_load(&libdl_loaded_here); }

/* One forwarding function per call: weak reference, else the cached resolution. */
#define COMPAT(lib, version, ret, name, params, args, fail)                                                            \
    extern __typeof__(vgpu_compat_##name) name __attribute__((weak));                                                  \
    static _Atomic(__typeof__(vgpu_compat_##name) *) resolved_##name;                                                  \
    ret vgpu_compat_##name params {                                                                                    \
        __typeof__(vgpu_compat_##name) *f = name;                                                                      \
        if (f == NULL) f = atomic_load_explicit(&resolved_##name, memory_order_acquire);                               \
        if (f == NULL) {                                                                                               \
            f = (__typeof__(vgpu_compat_##name) *)resolve(lib, #name, version);                                        \
            if (f == NULL) return fail;                                                                                \
            atomic_store_explicit(&resolved_##name, f, memory_order_release);                                          \
        }                                                                                                              \
        return f args;                                                                                                 \
    }

#undef dlopen
#undef dlclose
#undef dladdr
#undef dlerror
#undef pthread_create
#undef pthread_once
#undef pthread_attr_setstacksize
#undef pthread_sigmask
#undef pthread_mutex_trylock
#undef pthread_mutex_timedlock
#undef pthread_mutexattr_init
#undef pthread_mutexattr_destroy
#undef pthread_mutexattr_setpshared
#undef pthread_mutex_consistent
#undef pthread_mutexattr_setrobust

#define B VGPU_GLIBC_BASE
COMPAT(LIB_DL, B, void *, dlopen, (const char *file, int mode), (file, mode), NULL)
COMPAT(LIB_DL, B, int, dlclose, (void *handle), (handle), -1)
COMPAT(LIB_DL, B, int, dladdr, (const void *addr, Dl_info *info), (addr, info), 0)
COMPAT(LIB_DL, B, char *, dlerror, (void), (), NULL)
COMPAT(LIB_PTHREAD, B, int, pthread_create,
       (pthread_t *restrict t, const pthread_attr_t *restrict a, void *(*fn)(void *), void *restrict arg),
       (t, a, fn, arg), EAGAIN)
COMPAT(LIB_PTHREAD, B, int, pthread_attr_setstacksize, (pthread_attr_t * a, size_t n), (a, n), ENOSYS)
COMPAT(LIB_PTHREAD, B, int, pthread_sigmask, (int how, const sigset_t *restrict set, sigset_t *restrict old),
       (how, set, old), ENOSYS)
COMPAT(LIB_PTHREAD, B, int, pthread_mutex_trylock, (pthread_mutex_t * m), (m), ENOSYS)
COMPAT(LIB_PTHREAD, B, int, pthread_mutex_timedlock, (pthread_mutex_t *restrict m, const struct timespec *restrict t),
       (m, t), ENOSYS)
COMPAT(LIB_PTHREAD, B, int, pthread_mutexattr_init, (pthread_mutexattr_t * a), (a), ENOSYS)
COMPAT(LIB_PTHREAD, B, int, pthread_mutexattr_destroy, (pthread_mutexattr_t * a), (a), ENOSYS)
COMPAT(LIB_PTHREAD, B, int, pthread_mutexattr_setpshared, (pthread_mutexattr_t * a, int v), (a, v), ENOSYS)
COMPAT(LIB_PTHREAD, VGPU_GLIBC_ROBUST, int, pthread_mutex_consistent, (pthread_mutex_t * m), (m), ENOSYS)
COMPAT(LIB_PTHREAD, VGPU_GLIBC_ROBUST, int, pthread_mutexattr_setrobust, (pthread_mutexattr_t * a, int v), (a, v),
       ENOSYS)

/* lround and llroundf (libm): to the nearest integer, halves away from zero; NaN and values out
 * of range give LONG_MIN, as glibc's do on x86-64 (the callers pass small finite values).
 * x - t is exact: |x - t| < 1 is a multiple of x's unit in the last place. */
long vgpu_compat_lround(double x) {
    if (!(x > -9.2233720368547758e18 && x < 9.2233720368547758e18)) return LONG_MIN;
    long t = (long)x;
    double f = x - (double)t;
    if (f >= 0.5)
        t++;
    else if (f <= -0.5)
        t--;
    return t;
}

long long vgpu_compat_llroundf(float x) { return vgpu_compat_lround((double)x); }

/* pthread_once without libpthread: no other thread can exist, so running the routine on the
 * first call is the whole contract (PTHREAD_ONCE_INIT is 0; anything else means done). */
static int once_alone(pthread_once_t *o, void (*routine)(void)) {
    if (*o == 0) {
        *o = 2;
        routine();
    }
    return 0;
}
COMPAT(LIB_PTHREAD, B, int, pthread_once, (pthread_once_t * o, void (*routine)(void)), (o, routine),
       once_alone(o, routine))
#else
typedef int vgpu_compat_unused; /* not an empty translation unit */
#endif

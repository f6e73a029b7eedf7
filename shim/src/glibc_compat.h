/*
 * The oldest glibc symbol versions, so libvgpu.so loads into any glibc >= 2.17 image.
 *
 * The shim is mounted into containers it does not control: a symbol version their C library
 * lacks stops every process of the container at load. Linking against a new glibc binds each
 * call to that glibc's newest version (dlopen@GLIBC_2.34, fstat@GLIBC_2.33, ...), so this
 * header, force-included into every file of the shim by the normal build (shim/build.py),
 * binds the calls that moved to the version they had before: glibc keeps those as compatibility
 * symbols, so the same reference works on old and new C libraries. Before 2.34 the dl* and
 * pthread_* functions below lived in libdl.so.2 and libpthread.so.0, which are not in the shim's
 * DT_NEEDED (two more objects to map in every process, empty stubs on 2.34+): the calls are
 * renamed to vgpu_compat_<name> (compat.c), which calls a weak reference to the pinned version
 * where the C library has it (2.34+, or an old glibc whose process loaded libdl/libpthread at
 * start, as every program linked with them or with the driver does) and otherwise finds it in
 * the loaded objects or loads its library once. Calls whose only version is newer than
 * 2.17 are not made at all: fstat and memfd_create go through syscall() (vgpu_fstat,
 * vgpu_memfd_create in shim_internal.h). tests/shim/test_glibc_bound.py reads the built
 * library's version needs (objdump -T) and fails on anything newer than the bound.
 *
 * Includes nothing: it comes before each file's _GNU_SOURCE and headers.
 */
#ifndef VGPU_GLIBC_COMPAT_H
#define VGPU_GLIBC_COMPAT_H

#if defined(__x86_64__)
#define VGPU_GLIBC_BASE   "GLIBC_2.2.5" /* x86-64's first glibc ABI */
#define VGPU_GLIBC_ROBUST "GLIBC_2.12"  /* robust mutexes reached x86-64 in 2.12 */
#elif defined(__aarch64__)
#define VGPU_GLIBC_BASE   "GLIBC_2.17" /* aarch64's first glibc ABI: everything is 2.17 there */
#define VGPU_GLIBC_ROBUST "GLIBC_2.17"
#endif

#ifdef VGPU_GLIBC_BASE
#define VGPU_SYMVER(sym, ver) __asm__(".symver " #sym "," #sym "@" ver);

/* libdl before 2.34 (dlsym, dlvsym and dlmopen are the shim's own exports: the real dlvsym is
 * found in the C library's own symbol table, the others through it: dispatch.c) */
VGPU_SYMVER(dlopen, VGPU_GLIBC_BASE)
VGPU_SYMVER(dlclose, VGPU_GLIBC_BASE)
VGPU_SYMVER(dladdr, VGPU_GLIBC_BASE)
VGPU_SYMVER(dlerror, VGPU_GLIBC_BASE)
/* libpthread before 2.34 (pthread_sigmask moved to libc in 2.32) */
VGPU_SYMVER(pthread_create, VGPU_GLIBC_BASE)
VGPU_SYMVER(pthread_once, VGPU_GLIBC_BASE)
VGPU_SYMVER(pthread_attr_setstacksize, VGPU_GLIBC_BASE)
VGPU_SYMVER(pthread_sigmask, VGPU_GLIBC_BASE)
VGPU_SYMVER(pthread_mutex_trylock, VGPU_GLIBC_BASE)
VGPU_SYMVER(pthread_mutex_timedlock, VGPU_GLIBC_BASE)
VGPU_SYMVER(pthread_mutexattr_init, VGPU_GLIBC_BASE)
VGPU_SYMVER(pthread_mutexattr_destroy, VGPU_GLIBC_BASE)
VGPU_SYMVER(pthread_mutexattr_setpshared, VGPU_GLIBC_BASE)
VGPU_SYMVER(pthread_mutex_consistent, VGPU_GLIBC_ROBUST)
VGPU_SYMVER(pthread_mutexattr_setrobust, VGPU_GLIBC_ROBUST)

/* every call of these goes through compat.c (the declarations in the headers are renamed too) */
#define dlopen                       vgpu_compat_dlopen
#define dlclose                      vgpu_compat_dlclose
#define dladdr                       vgpu_compat_dladdr
#define dlerror                      vgpu_compat_dlerror
#define pthread_create               vgpu_compat_pthread_create
#define pthread_once                 vgpu_compat_pthread_once
#define pthread_attr_setstacksize    vgpu_compat_pthread_attr_setstacksize
#define pthread_sigmask              vgpu_compat_pthread_sigmask
#define pthread_mutex_trylock        vgpu_compat_pthread_mutex_trylock
#define pthread_mutex_timedlock      vgpu_compat_pthread_mutex_timedlock
#define pthread_mutexattr_init       vgpu_compat_pthread_mutexattr_init
#define pthread_mutexattr_destroy    vgpu_compat_pthread_mutexattr_destroy
#define pthread_mutexattr_setpshared vgpu_compat_pthread_mutexattr_setpshared
#define pthread_mutex_consistent     vgpu_compat_pthread_mutex_consistent
#define pthread_mutexattr_setrobust  vgpu_compat_pthread_mutexattr_setrobust

/* The only libm calls: rounding, done in compat.c, so libm.so.6 is not one more object loaded
 * into every process (the driver loads it where CUDA is used). */
#define lround   vgpu_compat_lround
#define llroundf vgpu_compat_llroundf
long vgpu_compat_lround(double x);
long long vgpu_compat_llroundf(float x);
#endif

#endif

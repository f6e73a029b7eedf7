/*
 * What every file of libvgpu.so may use: the export attribute and the system calls that stand in
 * for C library functions newer than the shim's glibc bound. No function of the shim is declared
 * here: each file's own header declares what it offers (x.h for x.c), so the #include lines show
 * which file uses which, and tests/shim/test_include_graph.py keeps them free of circles and in
 * the layers of docs/architecture.md.
 *
 * What a hook file (memory.c, launch_hooks.c, ...) can rely on:
 *  - Entries are added to hooks.def in the format documented at its top. For each entry you
 *    define `ret hook_<symbol> params` (hooks.h declares it; the default visibility of the shim is
 *    hidden). dispatch.c generates the exported wrapper and both maps (dlsym, cuGetProcAddress);
 *    symbols.c resolves real_<symbol> (the driver's function, NULL if the driver lacks it).
 *  - vgpu_init() (init.h) runs the one-time setup and returns CUDA_SUCCESS or the error the
 *    process fails closed with. Call it first in every hook; if it fails, return its value without
 *    calling the driver. vgpu_config()->disabled (config.h) means pure passthrough.
 *  - Device indices are as the application sees them (devices.h).
 */
#ifndef VGPU_SHIM_INTERNAL_H
#define VGPU_SHIM_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define VGPU_EXPORT __attribute__((visibility("default")))

/* fstat and memfd_create have no glibc symbol as old as the shim's bound (fstat@GLIBC_2.33,
 * memfd_create@GLIBC_2.27; see glibc_compat.h): the system calls themselves, whose struct stat
 * is glibc's on x86-64 and aarch64. */
static inline int vgpu_fstat(int fd, struct stat *st) { return (int)syscall(SYS_fstat, fd, st); }
static inline int vgpu_memfd_create(const char *name, unsigned int flags) {
    return (int)syscall(SYS_memfd_create, name, flags);
}

#endif

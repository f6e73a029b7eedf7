/*
 * The driver's functions (symbols.c): real_<symbol> for every entry of hooks.def, resolved from
 * the driver libraries the process loads, other driver functions by name, and the C library's
 * own dlsym/dlvsym (the shim exports its own, dispatch.c).
 */
#ifndef VGPU_SYMBOLS_H
#define VGPU_SYMBOLS_H

#include <stddef.h>
#include <stdint.h>

#include "vgpu/cuda_api.h"
#include "vgpu/nvml_api.h"

#define VGPU_HOOK(lib, ret, name, params, args)                                                                        \
    typedef ret(*vgpu_pfn_##name) params;                                                                              \
    extern vgpu_pfn_##name real_##name;
#include "hooks.def"
#undef VGPU_HOOK

/* Code that runs before anything is set up (dlsym is called while sanitizer runtimes and other
 * preloads initialise): no instrumentation. */
#define VGPU_EARLY_SAFE __attribute__((no_sanitize_address, no_sanitize("undefined")))

enum { VGPU_LIB_CUDA, VGPU_LIB_NVML };
/* One entry of hooks.def, in its order: its name, library and real_<symbol>. */
struct vgpu_symbol {
    const char *name;
    int lib;
    void **real;
};
extern const struct vgpu_symbol vgpu_symbols[];
extern const size_t vgpu_n_symbols;

/* Resolve every real_<symbol> of lib CUDA. Returns 0, or -1 if libcuda.so.1 cannot be loaded
 * (then the hooks return CUDA_ERROR_NOT_INITIALIZED or equivalent). */
int vgpu_resolve_cuda(void);
/* Resolve the real_<symbol> of lib NVML (lazily, at the first NVML hook). 0 ok, -1 no NVML. */
int vgpu_resolve_nvml(void);
/* 1 while this thread is inside the resolution of library lib (a driver library's constructor
 * looking one of its names up must not wait for the resolution it runs in). */
int vgpu_resolving_here(int lib);
/* A driver function we call but do not hook (cuDeviceGet, cuCtxGetDevice, nvmlDeviceGetIndex...),
 * from the same library instance; NULL if absent. Resolve once and cache the result. */
void *vgpu_cuda_sym(const char *name);
void *vgpu_nvml_sym(const char *name);
/* The C library's definition of `name` (what follows the shim: dlmopen.c's real dlmopen). */
void *vgpu_libc_sym(const char *name);
/* A name the driver libraries define (cu*, nvml*): the only names the shim maps. */
VGPU_EARLY_SAFE int vgpu_driver_name(const char *name);

struct dl_phdr_info;
/* 1 if the loaded object info maps addr (dl_iterate_phdr's view). */
int vgpu_object_contains(const struct dl_phdr_info *info, uintptr_t addr);

/* The C library's dlsym and dlvsym (NULL, reported once, without them: every lookup fails). */
typedef void *(*vgpu_dlsym_fn)(void *, const char *);
typedef void *(*vgpu_dlvsym_fn)(void *, const char *, const char *);
VGPU_EARLY_SAFE vgpu_dlsym_fn vgpu_real_dlsym(void);
VGPU_EARLY_SAFE vgpu_dlvsym_fn vgpu_real_dlvsym(void);
/* The one line saying there is no dlsym (written with the system call). */
VGPU_EARLY_SAFE void vgpu_report_no_dlsym(void);

#endif

/*
 * The exported wrappers generated from hooks.def (each calls its hook) and the two maps that make
 * the other call routes reach the hooks (the real_<symbol> they map from: symbols.c):
 *   dlsym(handle_of_driver, "symbol")   -> our wrapper of exactly that symbol (any handle whose
 *     answer is the driver's definition; RTLD_NEXT from an object loaded after the shim)
 *   cuGetProcAddress(_v2)(base, version, flags) -> the driver answers (it is the authority on
 *     versions); an answer equal to real_<symbol> becomes the wrapper of that same symbol.
 * Symbols not in hooks.def are never touched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "config.h"
#include "hooks.h"
#include "init.h"
#include "shim_internal.h"
#include "symbols.h"

/* ---- the exported wrappers, with hidden aliases so our own maps take their address directly
 * (not through the GOT, which an interposer loaded before us could redirect) ---- */
#define VGPU_HOOK(lib, ret, name, params, args)                                                                        \
    VGPU_EXPORT ret name params { return hook_##name args; }                                                           \
    extern __typeof__(name) vgpu_wrap_##name __attribute__((alias(#name), visibility("hidden")));
#include "hooks.def"
#undef VGPU_HOOK

struct entry {
    const char *name;
    int lib;
    void **real;
    void *wrapper;
};

static const struct entry entries[] = {
#define VGPU_HOOK(lib, ret, name, params, args)                                                                        \
    {#name, VGPU_LIB_##lib, (void **)&real_##name, (void *)&vgpu_wrap_##name},
#include "hooks.def"
#undef VGPU_HOOK
};
#define N_ENTRIES (sizeof entries / sizeof entries[0])

static void *vgpu_map_dlsym(const char *name, void *r);

static const struct entry *entry_by_name(const char *name) {
    for (size_t i = 0; i < N_ENTRIES; i++)
        if (strcmp(entries[i].name, name) == 0) return &entries[i];
    return NULL;
}

/* ---- dlsym ---- */

/* dlsym runs before anything is set up: its passthrough path touches no instrumented code, calls
 * no intercepted libc function, and must stay a tail call (RTLD_NEXT is relative to the caller's
 * address, so the real dlsym must see the application's return address, not ours). The same
 * holds for dlvsym. */
#define EARLY_SAFE VGPU_EARLY_SAFE

__attribute__((noinline)) static void *vgpu_next_hook(const char *name, const void *caller);

/* The tail call must not depend on the optimisation level the shim is built with. */
EARLY_SAFE __attribute__((optimize("optimize-sibling-calls"))) VGPU_EXPORT void *dlsym(void *handle, const char *name) {
    vgpu_dlsym_fn real = vgpu_real_dlsym();
    if (real == NULL) return NULL; /* reported once; nothing to pass through to */
    /* <dlfcn.h> declares name nonnull, but applications do pass NULL: launder the pointer so the
     * compiler keeps the check, and leave the NULL to the real dlsym */
    __asm__("" : "+r"(name));
    /* anything that is not a driver name is none of our business */
    if (name == NULL || !vgpu_driver_name(name)) return real(handle, name);
    if (handle == RTLD_NEXT) {
        /* RTLD_NEXT depends on the caller's address: the hook if the caller was loaded after us,
         * otherwise a tail call so the real dlsym sees the application as its caller */
        void *hook = vgpu_next_hook(name, __builtin_return_address(0));
        if (hook != NULL) return hook;
        return real(handle, name);
    }
    return vgpu_map_dlsym(name, real(handle, name));
}

__attribute__((noinline)) static void *vgpu_next_vhook(const char *name, const char *version, const void *caller);

/* dlvsym routes to the hooks as dlsym does. The driver's entry points carry no symbol version
 * (the C library's dlvsym then answers NULL for them), but a driver whose symbols are versioned
 * would hand its definitions out through dlvsym, which the shim's unversioned exports never
 * answer: every answer that is the driver's definition of a hooked name becomes its hook. */
EARLY_SAFE __attribute__((optimize("optimize-sibling-calls"))) VGPU_EXPORT void *dlvsym(void *handle, const char *name,
                                                                                        const char *version) {
    vgpu_dlvsym_fn real = vgpu_real_dlvsym();
    if (real == NULL) {
        vgpu_report_no_dlsym();
        return NULL;
    }
    __asm__("" : "+r"(name));
    if (name == NULL || !vgpu_driver_name(name)) return real(handle, name, version);
    if (handle == RTLD_NEXT) {
        void *hook = vgpu_next_vhook(name, version, __builtin_return_address(0));
        if (hook != NULL) return hook;
        return real(handle, name, version);
    }
    return vgpu_map_dlsym(name, real(handle, name, version));
}

/* Control is on and `e`'s library resolved: the wrapper may be handed out. */
static int hooks_apply(const struct entry *e) {
    if (vgpu_resolving_here(e->lib)) return 0;
    if (e->lib == VGPU_LIB_CUDA ? vgpu_resolve_cuda() : vgpu_resolve_nvml()) return 0;
    (void)vgpu_init(); /* CUDA_DISABLE_CONTROL=true: the driver's own pointers (pure passthrough) */
    return !vgpu_config()->disabled;
}

/* the part of dlsym for driver names: ordinary (instrumented) code */
static void *vgpu_map_dlsym(const char *name, void *r) {
    if (r == NULL) return r;
    const struct entry *e = entry_by_name(name);
    if (e == NULL || !hooks_apply(e)) return r;
    /* exactly the driver's definition of exactly this name becomes our wrapper of this name */
    return r == *e->real ? e->wrapper : r;
}

/* Where the caller sits in the load order relative to the shim (dl_iterate_phdr walks the
 * objects in that order, under the loader's lock, so no object goes away during the walk). */
struct load_order {
    uintptr_t caller, self;
    int self_seen, caller_after_self;
};

static int load_order_step(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct load_order *o = data;
    if (vgpu_object_contains(info, o->self)) {
        o->self_seen = 1;
        return vgpu_object_contains(info, o->caller); /* the shim itself: stop, not after */
    }
    if (!vgpu_object_contains(info, o->caller)) return 0;
    o->caller_after_self = o->self_seen;
    return 1;
}

static int loaded_after_shim(const void *caller) {
    struct load_order o = {(uintptr_t)caller, (uintptr_t)&vgpu_wrap_cuInit, 0, 0};
    dl_iterate_phdr(load_order_step, &o);
    return o.caller_after_self;
}

/* A driver library already in the process (dlsym must not load one as a side effect). */
static int lib_loaded(const struct entry *e) {
    void *h = dlopen(e->lib == VGPU_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL) return 0;
    dlclose(h);
    return 1;
}

/* dlsym(RTLD_NEXT, name) from `caller`. A caller loaded after the shim (a library dlopen'ed
 * later, a later preload, a dependency of the program) looks behind the shim, where the driver's
 * unhooked definition is: it gets the hook of exactly that name whenever the loaded driver
 * defines it. The C library computes RTLD_NEXT from the caller's address and offers no call that
 * takes it, so the answer the caller would have had is not recomputed: an interposer loaded
 * after the shim is skipped (as it is on every other route, the shim coming first), and a
 * caller whose scope lacks the driver gets the hook instead of NULL. Callers loaded before the
 * shim (the program, earlier preloads) get NULL here: the real dlsym answers them exactly. */
static void *vgpu_next_hook(const char *name, const void *caller) {
    const struct entry *e = entry_by_name(name);
    if (e == NULL || !lib_loaded(e) || !loaded_after_shim(caller) || !hooks_apply(e)) return NULL;
    return *e->real != NULL ? e->wrapper : NULL;
}

/* dlvsym(RTLD_NEXT, name, version) from `caller`: a caller after the shim as for dlsym. Before
 * the shim the shim's exports are no answer to a versioned lookup, so the search goes on past
 * them: what follows the shim is asked (from here), and the driver's definition becomes the
 * hook (an object between the caller and the shim defining name@version is passed over then:
 * it would only have been another interposer of a hooked name). NULL: ask for the caller. */
static void *vgpu_next_vhook(const char *name, const char *version, const void *caller) {
    void *hook = vgpu_next_hook(name, caller);
    if (hook != NULL || version == NULL) return hook;
    void *r = vgpu_real_dlvsym()(RTLD_NEXT, name, version);
    void *m = vgpu_map_dlsym(name, r);
    return m != r ? m : NULL;
}

/* ---- cuGetProcAddress ---- */

/* What the ABI table says a request resolves to (vgpu/cuda_procaddr.def), NULL if no row. */
static const char *procaddr_symbol(const char *base, int version, cuuint64_t flags) {
    const char *best = NULL;
    int best_ver = -1;
#define CU_PROC(b, ver, sym, ptds)                                                                                     \
    if (strcmp(base, #b) == 0 && ver <= version && ver > best_ver) {                                                   \
        best_ver = ver;                                                                                                \
        best = (sizeof(#ptds) > 1 && (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)) ? #ptds : #sym;          \
    }
#include "vgpu/cuda_procaddr.def"
#undef CU_PROC
    return best;
}

static void map_procaddr(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    if (pfn == NULL || *pfn == NULL) return;
    const struct vgpu_config *cfg = vgpu_config();
    if (cfg != NULL && cfg->disabled) return; /* pure passthrough */
    for (size_t i = 0; i < N_ENTRIES; i++) {
        if (entries[i].lib == VGPU_LIB_CUDA && *entries[i].real == *pfn) {
            *pfn = entries[i].wrapper;
            return;
        }
    }
    /* A driver may answer with an internal entry point rather than its exported symbol: then
     * the ABI table names the versioned symbol asked for, and that symbol's hook answers. */
    if (symbol == NULL) return;
    const char *exact = procaddr_symbol(symbol, version, flags);
    const struct entry *e = exact ? entry_by_name(exact) : NULL;
    if (e != NULL && e->lib == VGPU_LIB_CUDA) *pfn = e->wrapper;
}

CUresult hook_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult *symbolStatus) {
    if (vgpu_resolve_cuda() != 0 || real_cuGetProcAddress_v2 == NULL) return CUDA_ERROR_NOT_INITIALIZED;
    (void)vgpu_init(); /* for the passthrough switch; a config error is reported by the hooks */
    CUresult rc = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS) map_procaddr(symbol, pfn, cudaVersion, flags);
    return rc;
}

CUresult hook_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    if (vgpu_resolve_cuda() != 0 || real_cuGetProcAddress == NULL) return CUDA_ERROR_NOT_INITIALIZED;
    (void)vgpu_init();
    CUresult rc = real_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS) map_procaddr(symbol, pfn, cudaVersion, flags);
    return rc;
}

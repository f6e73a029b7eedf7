/*
 * Modules and libraries. The simulator runs no device code, so any image loads (cuModuleLoadData,
 * cuModuleLoadDataEx, cuLibraryLoadData; cuModuleLoad needs only a readable file) and any name
 * resolves to a function. The name sets the modelled duration (duration.c): sim_<N>us -> N us per
 * wave, else 10 us. Asking twice for one name in one module returns the same handle.
 *
 * Unloading invalidates the module's functions (magic cleared); their memory is kept so a stale
 * handle fails validation instead of reading freed memory.
 */
#include "module.h"

#include "argdur.h"
#include "ctxstack.h"
#include "fatbin.h"
#include "init.h"
#include "memory.h"
#include "modglobals.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_US_PER_WAVE 10

#define NO_MATCH UINT64_MAX

/* N if id[0..len) is "sim_<N>us", else NO_MATCH. */
static uint64_t sim_us_of(const char *id, size_t len) {
    if (len < 7 || strncmp(id, "sim_", 4) != 0 || id[len - 2] != 'u' || id[len - 1] != 's') return NO_MATCH;
    uint64_t us = 0;
    for (size_t i = 4; i < len - 2; i++) {
        if (id[i] < '0' || id[i] > '9') return NO_MATCH;
        if (us > 1000000000ull) return 1000000000ull;
        us = us * 10 + (uint64_t)(id[i] - '0');
    }
    return us;
}

static const char *read_len(const char *p, size_t *out) {
    size_t l = 0;
    if (*p < '1' || *p > '9') return NULL;
    while (*p >= '0' && *p <= '9' && l < 100000) l = l * 10 + (size_t)(*p++ - '0');
    *out = l;
    return p;
}

/* The kernel's modelled duration per wave. The name is sim_<N>us itself or, in an Itanium C++
 * mangling, any <length><identifier> component of it: a plain name (_Z9sim_500usPf) or a nested
 * one (_ZN8__main__10sim_2000usB2v1E..., numba; _ZN2ns10sim_100usEv), ABI tags (B<len><tag>),
 * CV qualifiers and std:: (St) skipped. Anything else: DEFAULT_US_PER_WAVE. */
static uint64_t parse_sim_us(const char *name) {
    size_t len = strlen(name);
    uint64_t us = sim_us_of(name, len);
    if (us != NO_MATCH) return us;
    if (len < 3 || name[0] != '_' || name[1] != 'Z') return DEFAULT_US_PER_WAVE;
    const char *p = name + 2;
    if (*p == 'N') {
        p++;
        while (*p == 'K' || *p == 'V' || *p == 'r') p++;
    }
    if (p[0] == 'S' && p[1] == 't') p += 2;
    for (int guard = 0; guard < 64; guard++) {
        size_t l;
        const char *id = read_len(p, &l);
        if (!id || l > strlen(id)) break;
        if ((us = sim_us_of(id, l)) != NO_MATCH) return us;
        p = id + l;
        while (*p == 'B') { /* ABI tag: B<len><tag> */
            const char *t = read_len(p + 1, &l);
            if (!t || l > strlen(t)) return DEFAULT_US_PER_WAVE;
            p = t + l;
        }
    }
    return DEFAULT_US_PER_WAVE;
}

struct CUfunc_st *sim_func_resolve(CUfunction f) {
    if (!f || (f->magic != MAGIC_FUNC && f->magic != MAGIC_KERNEL)) return NULL;
    if (f->mod && !SIM_OWNED_VALID(f->mod, MAGIC_MOD)) /* its module's context is gone */
        return NULL;
    return f;
}

static void module_free_globals_locked(struct CUmod_st *m) {
    for (size_t i = 0; i < m->nglobals; i++) {
        sim_alloc a;
        if (sim_alloc_remove((uintptr_t)m->globals[i].ptr, &a) == 0) sim_alloc_release_locked(&a);
        free(m->globals[i].name);
    }
    free(m->globals);
    m->globals = NULL;
    m->nglobals = 0;
}

static CUresult module_new(CUmodule *module, const void *image) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->gen = sim_gen();
    m->ctx = c;
    m->ctx_serial = c->serial;
    if (image && (rc = sim_module_globals(m, image)) != CUDA_SUCCESS) {
        pthread_mutex_lock(&G.lock);
        module_free_globals_locked(m);
        pthread_mutex_unlock(&G.lock);
        free(m);
        return rc;
    }
    m->magic = MAGIC_MOD;
    *module = m;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    return module_new(module, image);
}

SIM_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                       CUjit_option *options, void **optionValues) {
    if (!module || !image || (numOptions && (!options || !optionValues))) return CUDA_ERROR_INVALID_VALUE;
    return module_new(module, image);
}

/* A module file's image, NUL-terminated (NULL if empty or unreadable: no globals then).
 * CUDA_ERROR_FILE_NOT_FOUND if it cannot be opened. */
static CUresult read_image(const char *fname, char **out) {
    FILE *f = fopen(fname, "rb");
    if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
    char *img = NULL;
    long n = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (n > 0 && n < (1L << 30) && fseek(f, 0, SEEK_SET) == 0 && (img = calloc(1, (size_t)n + 1)) &&
        fread(img, 1, (size_t)n, f) != (size_t)n) {
        free(img);
        img = NULL;
    }
    fclose(f);
    *out = img;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname) {
    if (!module || !fname) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    char *img; /* read as the driver reads it: the file's globals are allocated too */
    if ((rc = read_image(fname, &img)) != CUDA_SUCCESS) return rc;
    rc = module_new(module, img);
    free(img);
    return rc;
}

SIM_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    if (!module || !fatCubin) return CUDA_ERROR_INVALID_VALUE;
    return module_new(module, fatCubin);
}

SIM_EXPORT CUresult cuModuleUnload(CUmodule hmod) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_OWNED_VALID(hmod, MAGIC_MOD)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (struct CUfunc_st *f = hmod->funcs; f; f = f->next) f->magic = MAGIC_DEAD;
    hmod->magic = MAGIC_DEAD;
    module_free_globals_locked(hmod);
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

static void func_init(struct CUfunc_st *f, char *name, uint32_t magic) {
    f->name = name;
    f->us_per_wave = parse_sim_us(name);
    f->dur_arg = sim_dur_arg_of_name(name);
    f->max_dyn_smem = 49152; /* the default dynamic shared memory limit (48 KiB) */
    f->carveout = -1;
    f->magic = magic;
}

SIM_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_OWNED_VALID(hmod, MAGIC_MOD)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct CUfunc_st *f;
    for (f = hmod->funcs; f; f = f->next)
        if (strcmp(f->name, name) == 0) break;
    if (!f) {
        f = calloc(1, sizeof *f);
        char *n = strdup(name);
        if (!f || !n) {
            free(f);
            free(n);
            pthread_mutex_unlock(&G.lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        func_init(f, n, MAGIC_FUNC);
        f->mod = hmod;
        f->next = hmod->funcs;
        hmod->funcs = f;
    }
    pthread_mutex_unlock(&G.lock);
    *hfunc = f;
    return CUDA_SUCCESS;
}

#define LIB_OPT_HOST_TABLE 0 /* CU_LIBRARY_HOST_UNIVERSAL_FUNCTION_AND_DATA_TABLE: a pointer value */
#define LIB_OPT_PRESERVED  1 /* CU_LIBRARY_BINARY_IS_PRESERVED: a flag */

/* Whether the library options are well formed, and whether the caller promised to keep the
 * image (*preserved). CU_LIBRARY_BINARY_IS_PRESERVED is a flag: its presence is the promise and
 * its value is not read, so it may come with no value array at all (cuBLASLt loads the cubins
 * of its CUTLASS kernels so). Only the host table option needs a value. An explicit value of 0
 * is taken as "not preserved": the option is a hint, and a copy is always correct. */
static int library_options_ok(const CUlibraryOption *opts, void *const *vals, unsigned n, int *preserved) {
    *preserved = 0;
    if (n && !opts) return 0;
    for (unsigned i = 0; i < n; i++) {
        if ((int)opts[i] == LIB_OPT_HOST_TABLE && !vals) return 0;
        if ((int)opts[i] == LIB_OPT_PRESERVED && (!vals || vals[i])) *preserved = 1;
    }
    return 1;
}

SIM_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                      void **jitOptionsValues, unsigned int numJitOptions,
                                      CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                      unsigned int numLibraryOptions) {
    int preserved;
    if (!library || !code || (numJitOptions && (!jitOptions || !jitOptionsValues)) ||
        !library_options_ok(libraryOptions, libraryOptionValues, numLibraryOptions, &preserved))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init(); /* libraries are context-independent: no context needed */
    if (rc != CUDA_SUCCESS) return rc;
    struct CUlib_st *l = calloc(1, sizeof *l);
    if (!l) return CUDA_ERROR_OUT_OF_MEMORY;
    const unsigned char *fb = sim_fatbin_header(code);
    if (fb) {
        /* A fat binary (the runtime's and the CUDA libraries' form): its globals are found at
         * the first lookup, as the real driver loads a library lazily. The image is kept: the
         * caller's, when it promised to keep it (CU_LIBRARY_BINARY_IS_PRESERVED), else a copy. */
        if (preserved) {
            l->fatbin = code;
        } else {
            size_t n = sim_fatbin_size(fb);
            l->fatbin_copy = malloc(n);
            if (!l->fatbin_copy) {
                free(l);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            memcpy(l->fatbin_copy, fb, n);
            l->fatbin = l->fatbin_copy;
        }
    }
    /* its globals are allocated in the context current at load, if any (a library loaded with
     * no context has none here: the real driver loads it into each context as it is used) */
    if (sim_current_ctx() && (rc = module_new(&l->mod, fb ? NULL : code)) != CUDA_SUCCESS) {
        free(l->fatbin_copy);
        free(l);
        return rc;
    }
    l->gen = sim_gen();
    l->magic = MAGIC_LIB;
    *library = l;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                          void **jitOptionsValues, unsigned int numJitOptions,
                                          CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                          unsigned int numLibraryOptions) {
    int preserved;
    if (!library || !fileName ||
        !library_options_ok(libraryOptions, libraryOptionValues, numLibraryOptions, &preserved))
        return CUDA_ERROR_INVALID_VALUE;
    /* the file's image lives only during the call: the preserved option is invalid here, as
     * documented, whatever its value */
    for (unsigned i = 0; i < numLibraryOptions; i++)
        if ((int)libraryOptions[i] == LIB_OPT_PRESERVED) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    char *img;
    if ((rc = read_image(fileName, &img)) != CUDA_SUCCESS) return rc;
    rc = cuLibraryLoadData(library, img ? img : "", jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                           libraryOptionValues, numLibraryOptions);
    free(img);
    return rc;
}

SIM_EXPORT CUresult cuLibraryUnload(CUlibrary library) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(library, MAGIC_LIB)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (struct CUkern_st *k = library->kernels; k; k = k->next) k->fn.magic = MAGIC_DEAD;
    library->magic = MAGIC_DEAD;
    if (library->mod && SIM_OWNED_VALID(library->mod, MAGIC_MOD)) { /* (else freed with its context) */
        library->mod->magic = MAGIC_DEAD;
        module_free_globals_locked(library->mod);
    }
    free(library->fatbin_copy);
    library->fatbin_copy = NULL;
    library->fatbin = NULL;
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    if (!pKernel || !name) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(library, MAGIC_LIB)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct CUkern_st *k;
    for (k = library->kernels; k; k = k->next)
        if (strcmp(k->fn.name, name) == 0) break;
    if (!k) {
        k = calloc(1, sizeof *k);
        char *n = strdup(name);
        if (!k || !n) {
            free(k);
            free(n);
            pthread_mutex_unlock(&G.lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        func_init(&k->fn, n, MAGIC_KERNEL);
        k->lib = library;
        k->next = library->kernels;
        library->kernels = k;
    }
    pthread_mutex_unlock(&G.lock);
    *pKernel = k;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuKernelGetLibrary(CUlibrary *pLib, CUkernel kernel) {
    if (!pLib) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!kernel || kernel->fn.magic != MAGIC_KERNEL) return CUDA_ERROR_INVALID_HANDLE;
    *pLib = kernel->lib;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    if (!pFunc) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c); /* the function of the kernel in the current context */
    if (rc != CUDA_SUCCESS) return rc;
    if (!kernel || kernel->fn.magic != MAGIC_KERNEL) return CUDA_ERROR_INVALID_HANDLE;
    *pFunc = &kernel->fn;
    return CUDA_SUCCESS;
}

static CUresult get_global(CUdeviceptr *dptr, size_t *bytes, struct CUmod_st *m, const char *name) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_OWNED_VALID(m, MAGIC_MOD)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    rc = CUDA_ERROR_NOT_FOUND;
    for (size_t i = 0; i < m->nglobals; i++) {
        if (strcmp(m->globals[i].name, name) == 0) {
            if (dptr) *dptr = m->globals[i].ptr;
            if (bytes) *bytes = m->globals[i].size;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&G.lock);
    return rc;
}

SIM_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod, const char *name) {
    return get_global(dptr, bytes, hmod, name);
}

/* The first lookup in a fat binary library loads its cubin's globals into the current context. */
static void library_load_fatbin(struct CUlib_st *l) {
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return;
    pthread_mutex_lock(&G.lock);
    int todo = !l->fatbin_parsed && l->fatbin;
    l->fatbin_parsed = 1;
    pthread_mutex_unlock(&G.lock);
    if (!todo) return;
    if (!l->mod && module_new(&l->mod, NULL) != CUDA_SUCCESS) return;
    const sim_device_cfg *d = &G.cfg->dev[l->mod->ctx->dev];
    sim_module_globals_fatbin(l->mod, l->fatbin, d->cc_major * 10 + d->cc_minor);
}

SIM_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_VALID(library, MAGIC_LIB)) return CUDA_ERROR_INVALID_HANDLE;
    library_load_fatbin(library);
    return library->mod ? get_global(dptr, bytes, library->mod, name) : CUDA_ERROR_NOT_FOUND;
}

/* The library's module in the current context (its globals, and functions looked up by name):
 * CUDA 12.9's runtime launches through it when its cuKernelGetFunction probe of the host stub
 * fails, where CUDA 13's asks cuLibraryGetKernel. */
SIM_EXPORT CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary library) {
    if (!pMod) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_VALID(library, MAGIC_LIB)) return CUDA_ERROR_INVALID_HANDLE;
    library_load_fatbin(library);
    if (!library->mod && (rc = module_new(&library->mod, NULL)) != CUDA_SUCCESS) return rc;
    *pMod = library->mod;
    return CUDA_SUCCESS;
}

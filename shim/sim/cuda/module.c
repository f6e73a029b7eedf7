/*
 * Modules and libraries. The simulator runs no device code, so any image loads (cuModuleLoadData,
 * cuModuleLoadDataEx, cuLibraryLoadData; cuModuleLoad needs only a readable file) and any name
 * resolves to a function. The name sets the modelled duration (launch.c): sim_<N>us -> N us per
 * wave, else 10 us. Asking twice for one name in one module returns the same handle.
 *
 * Unloading invalidates the module's functions (magic cleared); their memory is kept so a stale
 * handle fails validation instead of reading freed memory.
 */
#include "cuda_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_US_PER_WAVE 10

static uint64_t parse_sim_us(const char *name)
{
    const char *id = name;
    size_t len = strlen(name);
    if (len > 2 && name[0] == '_' && name[1] == 'Z' && name[2] >= '1' && name[2] <= '9') {
        /* Itanium mangling of a plain function: _Z<length><identifier><parameters> */
        size_t l = 0;
        const char *p = name + 2;
        while (*p >= '0' && *p <= '9' && l < 100000)
            l = l * 10 + (size_t)(*p++ - '0');
        if (l <= strlen(p)) {
            id = p;
            len = l;
        }
    }
    if (len < 7 || strncmp(id, "sim_", 4) != 0 || id[len - 2] != 'u' || id[len - 1] != 's')
        return DEFAULT_US_PER_WAVE;
    uint64_t us = 0;
    for (size_t i = 4; i < len - 2; i++) {
        if (id[i] < '0' || id[i] > '9')
            return DEFAULT_US_PER_WAVE;
        if (us > 1000000000ull)
            return 1000000000ull;
        us = us * 10 + (uint64_t)(id[i] - '0');
    }
    return us;
}

struct CUfunc_st *sim_func_resolve(CUfunction f)
{
    if (!f || (f->magic != MAGIC_FUNC && f->magic != MAGIC_KERNEL))
        return NULL;
    return f;
}

static CUresult module_new(CUmodule *module)
{
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->gen = sim_gen();
    m->magic = MAGIC_MOD;
    *module = m;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    return module_new(module);
}

SIM_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options, void **optionValues)
{
    if (!module || !image || (numOptions && (!options || !optionValues)))
        return CUDA_ERROR_INVALID_VALUE;
    return module_new(module);
}

SIM_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    if (!module || !fname)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    FILE *f = fopen(fname, "rb");
    if (!f)
        return CUDA_ERROR_FILE_NOT_FOUND;
    fclose(f);
    return module_new(module);
}

SIM_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(hmod, MAGIC_MOD)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (struct CUfunc_st *f = hmod->funcs; f; f = f->next)
        f->magic = MAGIC_DEAD;
    hmod->magic = MAGIC_DEAD;
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

static void func_init(struct CUfunc_st *f, char *name, uint32_t magic)
{
    f->name = name;
    f->us_per_wave = parse_sim_us(name);
    f->magic = magic;
}

SIM_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    if (!hfunc || !name)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(hmod, MAGIC_MOD)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct CUfunc_st *f;
    for (f = hmod->funcs; f; f = f->next)
        if (strcmp(f->name, name) == 0)
            break;
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
        f->next = hmod->funcs;
        hmod->funcs = f;
    }
    pthread_mutex_unlock(&G.lock);
    *hfunc = f;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
                                      unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                      unsigned int numLibraryOptions)
{
    if (!library || !code || (numJitOptions && (!jitOptions || !jitOptionsValues)) ||
        (numLibraryOptions && (!libraryOptions || !libraryOptionValues)))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init(); /* libraries are context-independent: no context needed */
    if (rc != CUDA_SUCCESS)
        return rc;
    struct CUlib_st *l = calloc(1, sizeof *l);
    if (!l)
        return CUDA_ERROR_OUT_OF_MEMORY;
    l->gen = sim_gen();
    l->magic = MAGIC_LIB;
    *library = l;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLibraryUnload(CUlibrary library)
{
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(library, MAGIC_LIB)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (struct CUkern_st *k = library->kernels; k; k = k->next)
        k->fn.magic = MAGIC_DEAD;
    library->magic = MAGIC_DEAD;
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    if (!pKernel || !name)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(library, MAGIC_LIB)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct CUkern_st *k;
    for (k = library->kernels; k; k = k->next)
        if (strcmp(k->fn.name, name) == 0)
            break;
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
        k->next = library->kernels;
        library->kernels = k;
    }
    pthread_mutex_unlock(&G.lock);
    *pKernel = k;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c); /* the function of the kernel in the current context */
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!kernel || kernel->fn.magic != MAGIC_KERNEL)
        return CUDA_ERROR_INVALID_HANDLE;
    *pFunc = &kernel->fn;
    return CUDA_SUCCESS;
}

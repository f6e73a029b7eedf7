/*
 * cuGetProcAddress / cuGetProcAddress_v2: entry points of this library by base name and CUDA
 * version, from the ABI table vgpu/cuda_procaddr.def (its header states the lookup rules). The
 * pointers returned are this library's own exported functions. Works before cuInit (the CUDA
 * runtime fetches cuInit itself through it).
 */
#include "cuda_internal.h"

#include <string.h>

typedef struct {
    const char *base;
    int version;
    void *fn;
    void *fn_ptds; /* NULL: no per-thread variant */
} proc_row;

static proc_row rows[512];
static size_t nrows;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void build(void)
{
    size_t i = 0;
    /* An empty per-thread column becomes an empty initializer, i.e. NULL. */
#define CU_PROC(b, v, s, p)                                                   \
    do {                                                                      \
        void *pt_[1] = { p };                                                 \
        if (i < sizeof rows / sizeof rows[0])                                 \
            rows[i++] = (proc_row){ #b, v, (void *)s, pt_[0] };               \
    } while (0);
#include "vgpu/cuda_procaddr.def"
#undef CU_PROC
    nrows = i;
}

static CUresult lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    if (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&once, build);
    const proc_row *best = NULL;
    int any = 0;
    for (size_t i = 0; i < nrows; i++) {
        if (strcmp(rows[i].base, symbol) != 0)
            continue;
        any = 1;
        if (rows[i].version <= cudaVersion && (!best || rows[i].version > best->version))
            best = &rows[i];
    }
    *pfn = NULL;
    if (!best) {
        if (status)
            *status = any ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    int ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    *pfn = ptds && best->fn_ptds ? best->fn_ptds : best->fn;
    if (status)
        *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    return lookup(symbol, pfn, cudaVersion, flags, symbolStatus);
}

SIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return lookup(symbol, pfn, cudaVersion, flags, NULL);
}

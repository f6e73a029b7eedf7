/*
 * cuGetProcAddress / cuGetProcAddress_v2: entry points of this library by base name and CUDA
 * version, from the ABI table vgpu/cuda_procaddr.def (its header states the lookup rules). Works
 * before cuInit (the CUDA runtime fetches cuInit itself through it).
 *
 * Like NVIDIA's driver, the pointers returned are internal entry points, not the exported symbols
 * (SIMGPU_PROCADDR=internal, the default): each is a small trampoline in an executable page of
 * its own that jumps to the function, so an interposer that compares the answer with the
 * exported symbols finds no match and must map it by name. SIMGPU_PROCADDR=exported returns the
 * exported functions themselves. Where no trampoline can be made (another architecture, or a
 * system that refuses executable mappings) the exported functions are returned.
 */
#include "init.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define TRAMP_SIZE 16

typedef struct {
    const char *base;
    int version;
    void *fn;
    void *fn_ptds; /* NULL: no per-thread variant */
} proc_row;

static proc_row rows[640];
static size_t nrows;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static void build_rows(void);

/* Write a jump to `target` at `at` (TRAMP_SIZE bytes); 0 if this architecture has none. */
static int write_tramp(unsigned char *at, void *target) {
#if defined(__x86_64__)
    static const unsigned char jmp[6] = {0xff, 0x25, 0, 0, 0, 0}; /* jmp *0(%rip) */
    memcpy(at, jmp, sizeof jmp);
    memcpy(at + 6, &target, sizeof target);
    memset(at + 14, 0xcc, 2);
    return 1;
#elif defined(__aarch64__)
    static const uint32_t code[2] = {0x58000050u, 0xd61f0200u}; /* ldr x16, #8; br x16 */
    memcpy(at, code, sizeof code);
    memcpy(at + 8, &target, sizeof target);
    return 1;
#else
    (void)at;
    (void)target;
    return 0;
#endif
}

/* Replace every pointer of the table by an internal entry point (one per distinct function). */
static void make_internal(void) {
    const char *mode = getenv("SIMGPU_PROCADDR");
    if (mode && strcmp(mode, "internal") != 0) {
        if (strcmp(mode, "exported") != 0)
            fprintf(stderr, "simgpu: SIMGPU_PROCADDR=%s: allowed: internal (default) or exported; using internal\n",
                    mode);
        else
            return;
    }
    size_t n = 2 * nrows, bytes = sim_align_up(n * TRAMP_SIZE, 4096);
    unsigned char *page = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) return;
    void **targets = calloc(n, sizeof *targets);
    size_t used = 0;
    if (!targets) goto fail;
    for (size_t i = 0; i < nrows; i++) {
        void **cols[2] = {&rows[i].fn, &rows[i].fn_ptds};
        for (int c = 0; c < 2; c++) {
            if (!*cols[c]) continue;
            size_t j = 0;
            while (j < used && targets[j] != *cols[c]) j++;
            if (j == used) {
                if (!write_tramp(page + used * TRAMP_SIZE, *cols[c])) goto fail;
                targets[used++] = *cols[c];
            }
            *cols[c] = page + j * TRAMP_SIZE;
        }
    }
    free(targets);
    if (mprotect(page, bytes, PROT_READ | PROT_EXEC) == 0) return;
    targets = NULL;
fail: /* keep (or go back to) the exported functions */
    free(targets);
    munmap(page, bytes);
    nrows = 0;
    build_rows();
}

static void build_rows(void) {
    size_t i = 0;
    /* An empty per-thread column becomes an empty initializer, i.e. NULL. */
#define CU_PROC(b, v, s, p)                                                                                            \
    do {                                                                                                               \
        void *pt_[1] = {p};                                                                                            \
        if (i < sizeof rows / sizeof rows[0]) rows[i++] = (proc_row){#b, v, (void *)s, pt_[0]};                        \
    } while (0);
#include "vgpu/cuda_procaddr.def"
#include "procaddr_ext.def"
#undef CU_PROC
    nrows = i;
}

static void build(void) {
    build_rows();
    make_internal();
}

static CUresult lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                       CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    if (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&once, build);
    const proc_row *best = NULL;
    int any = 0;
    for (size_t i = 0; i < nrows; i++) {
        if (strcmp(rows[i].base, symbol) != 0) continue;
        any = 1;
        if (rows[i].version <= cudaVersion && (!best || rows[i].version > best->version)) best = &rows[i];
    }
    *pfn = NULL;
    if (!best) {
        if (status) *status = any ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    int ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    *pfn = ptds && best->fn_ptds ? best->fn_ptds : best->fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus) {
    return lookup(symbol, pfn, cudaVersion, flags, symbolStatus);
}

SIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return lookup(symbol, pfn, cudaVersion, flags, NULL);
}

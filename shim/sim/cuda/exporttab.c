/*
 * cuGetExportTable: the driver's private tables that NVIDIA's CUDA runtime (libcudart 12 and 13,
 * hence CuPy, PyTorch, cuBLAS) asks for right after cuInit and without which it gives up.
 *
 * A table is an array of pointers, identified by a 16-byte UUID; where noted, slot 0 holds the
 * table's size in bytes. What each slot is, and what answer the runtime accepts, comes from
 * public reverse-engineering notes (credited in NOTICE) and from traces of the runtime on this
 * simulator; this file is our own implementation:
 *
 *   6bd5fb6c-...  runtime interface (13 slots, size): 1, 6, 8 load a module from a fat binary;
 *                 2 retains the device's primary context; 12 loads the JIT compilers (nothing).
 *   a094798c-...  tools callback hooks (7 slots, size): 2 and 6 hand out static buffers.
 *   42d85a81-...  tools thread-local state (4 slots, size): 2 the calling thread's context.
 *   c693336e-...  context-local storage (no size): put, delete, get (ctxstore.c).
 *   263e8860-...  context checks (no size): 2 checks a context (nothing to report), 3 -> 0.
 *   d4082055-...  integrity check (3 slots, size): 1 answers the keyed digest (integrity.c).
 *   21318c60-...  context identity: 4 = cuCtxGetId.
 *   f8cff951-...  a probe asked before cuInit: CUDA_ERROR_NOT_FOUND (a success changes the
 *                 runtime's initialisation path).
 * Any other UUID: CUDA_ERROR_INVALID_VALUE with a NULL table, as for an unknown table.
 *
 * Slots nobody has seen called hold a function that returns CUDA_ERROR_NOT_SUPPORTED (never a
 * NULL a caller would jump to); SIMGPU_TRACE_EXPORT=1 prints each call to one of them.
 */
#include "ctxstore.h"
#include "init.h"
#include "integrity.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define TRACE_UNKNOWN(table, slot)                                                                                     \
    static CUresult unk_##table##_##slot(void) {                                                                       \
        const char *t = getenv("SIMGPU_TRACE_EXPORT");                                                                 \
        if (t && *t && strcmp(t, "0") != 0)                                                                            \
            fprintf(stderr, "simgpu: private table %s slot %d called (not modelled)\n", #table, slot);                 \
        return CUDA_ERROR_NOT_SUPPORTED;                                                                               \
    }

/* ---------------------------------------------------------------- runtime interface */

static CUresult load_fatbin_module(CUmodule *module, const void *image) {
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    return cuModuleLoadData(module, image);
}

/* slot 1: (CUmodule *, const fatbin wrapper *) */
static CUresult rt_module_from_wrapper(CUmodule *module, const void *wrapper) {
    return load_fatbin_module(module, wrapper);
}

/* slot 2: (CUcontext *, CUdevice): the device's primary context, retained */
static CUresult rt_primary_ctx(CUcontext *pctx, CUdevice dev) { return cuDevicePrimaryCtxRetain(pctx, dev); }

/* slot 6: (CUmodule *, const fatbin wrapper *, ?, ?, unsigned) */
static CUresult rt_module_from_wrapper_ext(CUmodule *module, const void *wrapper, void *a3, void *a4, unsigned a5) {
    return load_fatbin_module(module, wrapper);
}

/* slot 7: (size_t) -> void */
static void rt_slot7(size_t arg) {}

/* slot 8: (const fatbin header *, CUmodule *, ?, ?, unsigned) */
static CUresult rt_module_from_fatbin_ext(const void *fatbin, CUmodule *module, void *a3, void *a4, unsigned a5) {
    return load_fatbin_module(module, fatbin);
}

/* slot 12: load the PTX compiler and NVVM: nothing to load here */
static CUresult rt_load_compilers(void) { return CUDA_SUCCESS; }

TRACE_UNKNOWN(runtime, 3)
TRACE_UNKNOWN(runtime, 4)
TRACE_UNKNOWN(runtime, 5)
TRACE_UNKNOWN(runtime, 9)
TRACE_UNKNOWN(runtime, 10)
TRACE_UNKNOWN(runtime, 11)

static const void *const runtime_table[13] = {
    (const void *)(13 * sizeof(void *)),
    (const void *)rt_module_from_wrapper,
    (const void *)rt_primary_ctx,
    (const void *)unk_runtime_3,
    (const void *)unk_runtime_4,
    (const void *)unk_runtime_5,
    (const void *)rt_module_from_wrapper_ext,
    (const void *)rt_slot7,
    (const void *)rt_module_from_fatbin_ext,
    (const void *)unk_runtime_9,
    (const void *)unk_runtime_10,
    (const void *)unk_runtime_11,
    (const void *)rt_load_compilers,
};

/* ---------------------------------------------------------------- tools callback hooks */

static unsigned char hooks_buf1[1024], hooks_buf2[14];

static void hooks_buffer1(void **buf, size_t *size) {
    if (buf) *buf = hooks_buf1;
    if (size) *size = sizeof hooks_buf1;
}

static void hooks_buffer2(void **buf, size_t *size) {
    if (buf) *buf = hooks_buf2;
    if (size) *size = sizeof hooks_buf2;
}

/* slots 1 and 4 are called at many runtime calls (a tools callback would be notified): nothing
 * is subscribed, and the runtime goes on whatever they answer */
static CUresult hooks_notify_1(void) { return CUDA_ERROR_NOT_SUPPORTED; }
static CUresult hooks_notify_4(void) { return CUDA_ERROR_NOT_SUPPORTED; }
TRACE_UNKNOWN(hooks, 3)
TRACE_UNKNOWN(hooks, 5)

static const void *const hooks_table[7] = {
    (const void *)(7 * sizeof(void *)), (const void *)hooks_notify_1, (const void *)hooks_buffer1,
    (const void *)unk_hooks_3,          (const void *)hooks_notify_4, (const void *)unk_hooks_5,
    (const void *)hooks_buffer2,
};

/* ---------------------------------------------------------------- tools thread-local state */

/* slot 2: (CUcontext *): the calling thread's current context (NULL if none). cuBLASLt asks it,
 * then the context's identity (context identity table, slot 4), before every heuristic query. */
static CUresult tls_current_ctx(CUcontext *pctx) { return cuCtxGetCurrent(pctx); }

TRACE_UNKNOWN(tls, 1)
TRACE_UNKNOWN(tls, 3)

static const void *const tls_table[4] = {
    (const void *)(4 * sizeof(void *)),
    (const void *)unk_tls_1,
    (const void *)tls_current_ctx,
    (const void *)unk_tls_3,
};

/* ---------------------------------------------------------------- context checks */

/* slot 2: (CUcontext, unsigned *flags, const void **detail): nothing to report about any context */
static CUresult checks_ctx(CUcontext ctx, unsigned *flags, const void **detail) {
    if (flags) *flags = 0;
    return CUDA_SUCCESS;
}

static unsigned checks_global(void) { return 0; }
TRACE_UNKNOWN(checks, 0)
TRACE_UNKNOWN(checks, 1)

static const void *const checks_table[4] = {
    (const void *)unk_checks_0,
    (const void *)unk_checks_1,
    (const void *)checks_ctx,
    (const void *)checks_global,
};

/* ---------------------------------------------------------------- integrity check */

static const void *const integrity_table[3];

static CUresult integrity_check(unsigned version, uint64_t unix_seconds, uint64_t out[2]) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    int drv = 0;
    cuDriverGetVersion(&drv);
    sim_integrity_digest(version, unix_seconds, (uint32_t)drv, (uint32_t)getpid(), (uint32_t)pthread_self(),
                         runtime_table, integrity_table, integrity_table[1], out);
    return CUDA_SUCCESS;
}

TRACE_UNKNOWN(integrity, 2)

static const void *const integrity_table[3] = {
    (const void *)(3 * sizeof(void *)),
    (const void *)integrity_check,
    (const void *)unk_integrity_2,
};

/* ---------------------------------------------------------------- context identity */

TRACE_UNKNOWN(ident, 1)
TRACE_UNKNOWN(ident, 2)
TRACE_UNKNOWN(ident, 3)
TRACE_UNKNOWN(ident, 5)
TRACE_UNKNOWN(ident, 6)
TRACE_UNKNOWN(ident, 7)

static const void *const ident_table[8] = {
    (const void *)(8 * sizeof(void *)), (const void *)unk_ident_1, (const void *)unk_ident_2, (const void *)unk_ident_3,
    (const void *)cuCtxGetId,           (const void *)unk_ident_5, (const void *)unk_ident_6, (const void *)unk_ident_7,
};

/* ---------------------------------------------------------------- cuBLASLt's table */

/* Asked by cuBLASLt 13 for half-precision and bfloat16 heuristics on Hopper; a refusal crashes it
 * (it calls slot 4 of the table it did not get), so NVIDIA's driver evidently always has it.
 * Slot 4, (void **, void **), answered "not supported", makes cuBLASLt go on without it. */
TRACE_UNKNOWN(lt, 1)
TRACE_UNKNOWN(lt, 2)
TRACE_UNKNOWN(lt, 3)
TRACE_UNKNOWN(lt, 4)
TRACE_UNKNOWN(lt, 5)
TRACE_UNKNOWN(lt, 6)
TRACE_UNKNOWN(lt, 7)

static const void *const lt_table[8] = {
    (const void *)(8 * sizeof(void *)),
    (const void *)unk_lt_1,
    (const void *)unk_lt_2,
    (const void *)unk_lt_3,
    (const void *)unk_lt_4,
    (const void *)unk_lt_5,
    (const void *)unk_lt_6,
    (const void *)unk_lt_7,
};

/* ---------------------------------------------------------------- lookup */

typedef struct {
    unsigned char id[16];
    const void *table; /* NULL: refused with `refusal` */
    CUresult refusal;
} export_row;

static const export_row rows[] = {
    {{0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9},
     runtime_table,
     0},
    {{0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66}, hooks_table, 0},
    {{0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc}, tls_table, 0},
    {{0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93},
     NULL,
     0}, /* ctxstore.c */
    {{0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e}, checks_table, 0},
    {{0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2},
     integrity_table,
     0},
    {{0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2}, ident_table, 0},
    {{0x17, 0x34, 0xdc, 0x26, 0x80, 0x0d, 0x47, 0x45, 0x87, 0x26, 0xc0, 0xf1, 0xe7, 0xdd, 0x8b, 0xca}, lt_table, 0},
    {{0xf8, 0xcf, 0xf9, 0x51, 0x21, 0x46, 0x8b, 0x4e, 0xb9, 0xe2, 0xfb, 0x46, 0x9e, 0x7c, 0x0d, 0xd9},
     NULL,
     CUDA_ERROR_NOT_FOUND},
};

SIM_EXPORT CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId) {
    if (!ppExportTable || !pExportTableId) return CUDA_ERROR_INVALID_VALUE;
    *ppExportTable = NULL;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        if (memcmp(rows[i].id, pExportTableId->bytes, 16) != 0) continue;
        if (i == 3) {
            *ppExportTable = sim_ctxstore_table();
            return CUDA_SUCCESS;
        }
        if (!rows[i].table) return rows[i].refusal;
        *ppExportTable = rows[i].table;
        return CUDA_SUCCESS;
    }
    const char *t = getenv("SIMGPU_TRACE_EXPORT");
    if (t && *t && strcmp(t, "0") != 0) {
        const unsigned char *b = (const unsigned char *)pExportTableId->bytes;
        fprintf(stderr, "simgpu: private table %02x%02x%02x%02x-... refused\n", b[0], b[1], b[2], b[3]);
    }
    return CUDA_ERROR_INVALID_VALUE;
}

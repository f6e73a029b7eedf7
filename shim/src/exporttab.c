/*
 * The CUDA runtime's private tables. NVIDIA's runtime (libcudart 12 and 13, hence PyTorch, CuPy,
 * cuBLAS) does not retain the primary context with cuDevicePrimaryCtxRetain: it asks the driver
 * for a private table (cuGetExportTable, UUID 6bd5fb6c-5bf4-e74a-8987-d93912fd9df9, the
 * "runtime interface") and calls its slot 2, `(CUcontext *, CUdevice) -> CUresult`, inside the
 * driver, where no hook sees it.
 *
 * The table cannot be handed out wrapped: the runtime's integrity check (another private table)
 * is a keyed digest over, among other things, the address of the table the driver owns, which
 * the runtime compares with the address it was given: a copy fails it ("integrity checks
 * failed", cudaErrorSoftwareValidityNotEstablished). So every table is the driver's answer,
 * unchanged, and a process that was handed the runtime interface has its primary contexts
 * adopted at first sight (context.c, vgpu_primary_adopt): charged before its first allocation and
 * its first cuMemGetInfo on the device.
 */
#include <string.h>

#include "context.h"
#include "hooks.h"
#include "init.h"
#include "symbols.h"

static const unsigned char runtime_interface[16] = {0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a,
                                                    0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9};

CUresult hook_cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId) {
    /* asked before cuInit too: resolve and configure, but nothing that needs the driver up */
    VGPU_HOOK_OPEN(real_cuGetExportTable);
    CUresult rc = real_cuGetExportTable(ppExportTable, pExportTableId);
    if (rc == CUDA_SUCCESS && ppExportTable != NULL && *ppExportTable != NULL && pExportTableId != NULL &&
        memcmp(pExportTableId->bytes, runtime_interface, sizeof runtime_interface) == 0)
        vgpu_primary_runtime_route();
    return rc;
}

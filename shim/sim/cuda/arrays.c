/*
 * CUDA arrays (and mipmapped arrays). They hold no data here (no texture or array copies are
 * simulated); they exist to be charged realistically to the device:
 *
 *   element  = bytes of the format (8-bit 1, 16-bit and half 2, 32-bit and float 4) * channels
 *   pitch    = align_up(width * element, 512)                 (row pitch, as for pitched memory)
 *   bytes    = pitch * max(height, 1) * max(depth, 1)          (layers and cubemap faces are depth)
 *   charged  = align_up(bytes, 2 MiB)                          (arrays live in whole large pages)
 *
 * A mipmapped array is charged the sum of its levels' bytes (each level halves every extent,
 * down to 1), rounded up once to 2 MiB.
 *
 * CUDA_ARRAY3D_DEFERRED_MAPPING (CUDA 11.6) creates an array without memory: nothing is charged,
 * and cuArrayGetMemoryRequirements / cuMipmappedArrayGetMemoryRequirements report what it needs
 * (the charge above, alignment 2 MiB); for an array created with memory they return
 * CUDA_ERROR_INVALID_VALUE, as NVIDIA documents.
 */
#include "arrays.h"

#include "ctxstack.h"
#include "init.h"

#include "../common/state.h"
#include "../common/util.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define SIM_ARRAY_GRANULE (2ull << 20) /* arrays are charged in whole 2 MiB granules */

/* The row pitch alignment of cuMemAllocPitch and of arrays: the driver's choice, reported by no
 * attribute (SIMGPU_PITCH_ALIGNMENT, default 512; read once). */
uint64_t sim_pitch_alignment(void) {
    static _Atomic uint64_t cached;
    uint64_t a = atomic_load_explicit(&cached, memory_order_relaxed);
    if (a) return a;
    a = sim_env_u64("SIMGPU_PITCH_ALIGNMENT", 512);
    if (a < 32 || a > 4096 || (a & (a - 1))) {
        sim_log("environment SIMGPU_PITCH_ALIGNMENT=%llu: allowed: a power of two from 32 to 4096; using 512",
                (unsigned long long)a);
        a = 512;
    }
    uint64_t zero = 0;
    if (!atomic_compare_exchange_strong(&cached, &zero, a)) a = zero; /* another thread decided (and logged) first */
    return a;
}

static unsigned format_bytes(CUarray_format f) {
    switch ((int)f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 0;
    }
}

/* Bytes of one level; 0 when the descriptor is invalid. */
static uint64_t level_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format fmt, unsigned ch) {
    unsigned fb = format_bytes(fmt);
    if (!fb || (ch != 1 && ch != 2 && ch != 4) || w == 0 || w > (1u << 24) || h > (1u << 24) || d > (1u << 24))
        return 0;
    uint64_t pitch = sim_align_up(w * fb * ch, SIM_PITCH_ALIGN);
    unsigned __int128 b = (unsigned __int128)pitch * (h ? h : 1) * (d ? d : 1);
    return b > (1ull << 52) ? 0 : (uint64_t)b;
}

static CUresult check_3d(const CUDA_ARRAY3D_DESCRIPTOR *a) {
    if (a->Flags & ~(unsigned)(CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_SURFACE_LDST | CUDA_ARRAY3D_CUBEMAP | 0x08 | 0x20 |
                               CUDA_ARRAY3D_DEFERRED_MAPPING))
        return CUDA_ERROR_INVALID_VALUE;
    if ((a->Flags & CUDA_ARRAY3D_CUBEMAP) && (a->Width != a->Height || a->Depth == 0 || a->Depth % 6))
        return CUDA_ERROR_INVALID_VALUE;                         /* cubemaps: square faces, depth 6 (or 6 * layers) */
    if (a->Depth && !a->Height) return CUDA_ERROR_INVALID_VALUE; /* 3D needs a height */
    return CUDA_SUCCESS;
}

/* Charge what an array of `bytes` takes; a deferred-mapping one only records it in *required. */
static CUresult charge(int dev, uint64_t bytes, unsigned flags, uint64_t *charged, uint64_t *required) {
    *charged = sim_align_up(bytes, SIM_ARRAY_GRANULE);
    *required = 0;
    if (flags & CUDA_ARRAY3D_DEFERRED_MAPPING) {
        *required = *charged;
        *charged = 0;
        return CUDA_SUCCESS;
    }
    pthread_mutex_lock(&G.lock);
    int rc = sim_mem_charge(G.slot, sim_phys(dev), *charged, G.cfg->dev[dev].memory);
    pthread_mutex_unlock(&G.lock);
    return rc == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult array_create(CUarray *ph, uint64_t w, uint64_t h, uint64_t d, CUarray_format fmt, unsigned ch,
                             unsigned flags) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    uint64_t bytes = level_bytes(w, h, d, fmt, ch);
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    struct CUarray_st *a = calloc(1, sizeof *a);
    if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
    if ((rc = charge(c->dev, bytes, flags, &a->charged, &a->required)) != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    a->dev = c->dev;
    a->gen = sim_gen();
    a->magic = MAGIC_ARRAY;
    *ph = a;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray) {
    if (!pHandle || !pAllocateArray) return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, pAllocateArray->Width, pAllocateArray->Height, 0, pAllocateArray->Format,
                        pAllocateArray->NumChannels, 0);
}

SIM_EXPORT CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *pAllocateArray) {
    if (!pHandle || !pAllocateArray) return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, pAllocateArray->Width, pAllocateArray->Height, 0, pAllocateArray->Format,
                        pAllocateArray->NumChannels, 0);
}

SIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray) {
    if (!pHandle || !pAllocateArray) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = check_3d(pAllocateArray);
    if (rc != CUDA_SUCCESS) return rc;
    return array_create(pHandle, pAllocateArray->Width, pAllocateArray->Height, pAllocateArray->Depth,
                        pAllocateArray->Format, pAllocateArray->NumChannels, pAllocateArray->Flags);
}

SIM_EXPORT CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *pAllocateArray) {
    if (!pHandle || !pAllocateArray) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d = {pAllocateArray->Width,  pAllocateArray->Height,      pAllocateArray->Depth,
                                 pAllocateArray->Format, pAllocateArray->NumChannels, pAllocateArray->Flags};
    return cuArray3DCreate_v2(pHandle, &d);
}

SIM_EXPORT CUresult cuArrayDestroy(CUarray hArray) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(hArray, MAGIC_ARRAY)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    hArray->magic = MAGIC_DEAD; /* kept, not freed: a stale handle fails validation */
    sim_mem_uncharge(G.slot, sim_phys(hArray->dev), hArray->charged);
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                           unsigned int numMipmapLevels) {
    if (!pHandle || !desc || numMipmapLevels == 0) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if ((rc = check_3d(desc)) != CUDA_SUCCESS) return rc;
    uint64_t w = desc->Width, h = desc->Height, d = desc->Depth, total = 0;
    uint64_t maxdim = w > h ? w : h;
    int layered = (desc->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    if (!layered && d > maxdim) maxdim = d;
    unsigned levels_possible = 1;
    while (maxdim >> levels_possible) levels_possible++;
    if (numMipmapLevels > levels_possible) return CUDA_ERROR_INVALID_VALUE;
    for (unsigned l = 0; l < numMipmapLevels; l++) {
        uint64_t b = level_bytes(w, h, d, desc->Format, desc->NumChannels);
        if (!b) return CUDA_ERROR_INVALID_VALUE;
        total += b;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : (h ? 1 : 0);
        if (!layered) d = d > 1 ? d / 2 : (d ? 1 : 0);
    }
    struct CUmipmappedArray_st *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    if ((rc = charge(c->dev, total, desc->Flags, &m->charged, &m->required)) != CUDA_SUCCESS) {
        free(m);
        return rc;
    }
    m->dev = c->dev;
    m->gen = sim_gen();
    m->magic = MAGIC_MIPMAP;
    *pHandle = m;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(hMipmappedArray, MAGIC_MIPMAP)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    hMipmappedArray->magic = MAGIC_DEAD;
    sim_mem_uncharge(G.slot, sim_phys(hMipmappedArray->dev), hMipmappedArray->charged);
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

static CUresult requirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *out, int valid, int dev, uint64_t required,
                             CUdevice device) {
    if (!valid) return CUDA_ERROR_INVALID_HANDLE;
    if (!out || required == 0 || sim_check_device(device) != CUDA_SUCCESS || device != dev)
        return CUDA_ERROR_INVALID_VALUE; /* not created with CUDA_ARRAY3D_DEFERRED_MAPPING, or another device */
    memset(out, 0, sizeof *out);
    out->size = (size_t)required;
    out->alignment = (size_t)SIM_ARRAY_GRANULE;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *memoryRequirements, CUarray array,
                                                 CUdevice device) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    int valid = SIM_VALID(array, MAGIC_ARRAY);
    rc = requirements(memoryRequirements, valid, valid ? array->dev : -1, valid ? array->required : 0, device);
    pthread_mutex_unlock(&G.lock);
    return rc;
}

SIM_EXPORT CUresult cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *memoryRequirements,
                                                          CUmipmappedArray mipmap, CUdevice device) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    int valid = SIM_VALID(mipmap, MAGIC_MIPMAP);
    rc = requirements(memoryRequirements, valid, valid ? mipmap->dev : -1, valid ? mipmap->required : 0, device);
    pthread_mutex_unlock(&G.lock);
    return rc;
}

/*
 * 2D and 3D copies (cuMemcpy2D, cuMemcpy3D and their async / per-thread forms) between host,
 * device and unified memory, row by row; each row is checked like a 1D copy (a device range
 * outside one live allocation is CUDA_ERROR_INVALID_VALUE). CUDA arrays hold no data in the
 * simulator (they are charged, not backed), so copies to or from an array are
 * CUDA_ERROR_NOT_SUPPORTED (a documented limit). Async forms move the data at the call, like the
 * 1D async copies; they are not recorded into a capturing stream (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED).
 */
#include "init.h"
#include "memory.h"
#include "stream.h"

#include <string.h>

typedef struct {
    CUmemorytype type;
    const void *host;
    CUdeviceptr dev;
    CUarray array;
    size_t x, y, z, pitch, height;
} side;

static CUresult side_ptr(const side *s, size_t y, size_t z, size_t width, uintptr_t *out) {
    size_t row = ((s->z + z) * s->height + s->y + y) * s->pitch + s->x;
    switch ((int)s->type) {
    case CU_MEMORYTYPE_HOST:
        if (!s->host) return CUDA_ERROR_INVALID_VALUE;
        *out = (uintptr_t)s->host + row;
        return CUDA_SUCCESS;
    case CU_MEMORYTYPE_DEVICE:
    case CU_MEMORYTYPE_UNIFIED: {
        if (!s->dev) return CUDA_ERROR_INVALID_VALUE;
        CUresult rc = sim_check_device_range(s->dev + row, width);
        if (rc != CUDA_SUCCESS && s->type == CU_MEMORYTYPE_UNIFIED && !sim_range_meets_allocation(s->dev + row, width))
            rc = CUDA_SUCCESS; /* unified addressing: a host pointer */
        if (rc != CUDA_SUCCESS) return rc;
        *out = (uintptr_t)(s->dev + row);
        return CUDA_SUCCESS;
    }
    case CU_MEMORYTYPE_ARRAY: return CUDA_ERROR_NOT_SUPPORTED;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

static CUresult copy_nd(const side *src, const side *dst, size_t width, size_t height, size_t depth, int async,
                        CUstream h, int ptds) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    struct CUstream_st *s;
    rc = sim_resolve_stream(async ? h : NULL, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (s->capturing) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (width == 0 || height == 0 || depth == 0) return CUDA_SUCCESS;
    if ((height > 1 || depth > 1) && (src->pitch < src->x + width || dst->pitch < dst->x + width))
        return CUDA_ERROR_INVALID_VALUE;
    if (depth > 1 && (src->height < src->y + height || dst->height < dst->y + height)) return CUDA_ERROR_INVALID_VALUE;
    /* check every row before moving any byte */
    for (size_t z = 0; z < depth; z++)
        for (size_t y = 0; y < height; y++) {
            uintptr_t a, b;
            if ((rc = side_ptr(src, y, z, width, &a)) != CUDA_SUCCESS ||
                (rc = side_ptr(dst, y, z, width, &b)) != CUDA_SUCCESS)
                return rc;
        }
    if (!async) sim_stream_drain(s);
    for (size_t z = 0; z < depth; z++)
        for (size_t y = 0; y < height; y++) {
            uintptr_t a, b;
            side_ptr(src, y, z, width, &a);
            side_ptr(dst, y, z, width, &b);
            memmove((void *)b, (const void *)a, width);
        }
    return CUDA_SUCCESS;
}

static CUresult copy2d(const CUDA_MEMCPY2D *p, int async, CUstream h, int ptds) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    side src = {p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray, p->srcXInBytes, p->srcY, 0, p->srcPitch, 0};
    side dst = {p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray, p->dstXInBytes, p->dstY, 0, p->dstPitch, 0};
    return copy_nd(&src, &dst, p->WidthInBytes, p->Height, 1, async, h, ptds);
}

static CUresult copy3d(const CUDA_MEMCPY3D *p, int async, CUstream h, int ptds) {
    if (!p || p->srcLOD || p->dstLOD || p->reserved0 || p->reserved1) return CUDA_ERROR_INVALID_VALUE;
    side src = {p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray, p->srcXInBytes,
                p->srcY,          p->srcZ,    p->srcPitch,  p->srcHeight};
    side dst = {p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray, p->dstXInBytes,
                p->dstY,          p->dstZ,    p->dstPitch,  p->dstHeight};
    return copy_nd(&src, &dst, p->WidthInBytes, p->Height, p->Depth, async, h, ptds);
}

SIM_EXPORT CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *pCopy) { return copy2d(pCopy, 0, NULL, 0); }
SIM_EXPORT CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *pCopy) { return copy2d(pCopy, 0, NULL, 0); }
SIM_EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *pCopy, CUstream hStream) {
    return copy2d(pCopy, 1, hStream, 0);
}
SIM_EXPORT CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D *pCopy) { return copy3d(pCopy, 0, NULL, 0); }
SIM_EXPORT CUresult cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *pCopy, CUstream hStream) {
    return copy3d(pCopy, 1, hStream, 0);
}
SIM_EXPORT CUresult cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D *pCopy) { return copy2d(pCopy, 0, NULL, 1); }
SIM_EXPORT CUresult cuMemcpy2DUnaligned_v2_ptds(const CUDA_MEMCPY2D *pCopy) { return copy2d(pCopy, 0, NULL, 1); }
SIM_EXPORT CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *pCopy, CUstream hStream) {
    return copy2d(pCopy, 1, hStream, 1);
}
SIM_EXPORT CUresult cuMemcpy3D_v2_ptds(const CUDA_MEMCPY3D *pCopy) { return copy3d(pCopy, 0, NULL, 1); }
SIM_EXPORT CUresult cuMemcpy3DAsync_v2_ptsz(const CUDA_MEMCPY3D *pCopy, CUstream hStream) {
    return copy3d(pCopy, 1, hStream, 1);
}

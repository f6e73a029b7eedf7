/*
 * Copies and memsets. Data moves at the call (the simulator has no copy engine), so results are
 * visible immediately; only their ordering with kernels is modelled:
 *  - synchronous forms (cuMemcpyHtoD_v2, cuMemsetD8_v2, ...) first wait for the work queued on
 *    the legacy stream (the per-thread stream for the _ptds forms), as they are issued there;
 *  - asynchronous forms return at once (during stream capture they become graph nodes).
 * Copies take no device time. Device pointers are checked against the allocation table: a range
 * outside one live allocation is CUDA_ERROR_INVALID_VALUE, never a crash. cuMemcpy / cuMemcpyAsync
 * (unified addressing) also accept host pointers that are not allocations.
 */
#include "copy.h"

#include "graph.h"
#include "init.h"
#include "memory.h"
#include "stream.h"

#include <string.h>

CUresult sim_copy_exec(CUdeviceptr dst, const void *src_host, CUdeviceptr src, void *dst_host, size_t n) {
    void *d = dst ? (void *)(uintptr_t)dst : dst_host;
    const void *s = src ? (const void *)(uintptr_t)src : src_host;
    if (n) memmove(d, s, n);
    return CUDA_SUCCESS;
}

CUresult sim_memset_exec(CUdeviceptr dst, unsigned value, size_t n, int elem) {
    if (elem == 1) {
        memset((void *)(uintptr_t)dst, (int)(value & 0xff), n);
    } else {
        uint32_t *p = (uint32_t *)(uintptr_t)dst;
        for (size_t i = 0; i < n; i++) p[i] = value;
    }
    return CUDA_SUCCESS;
}

enum { DEV_REQUIRED, DEV_OR_HOST };

static CUresult check_ptr(CUdeviceptr p, size_t n, int mode) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device_range(p, n);
    if (rc != CUDA_SUCCESS && mode == DEV_OR_HOST) {
        /* Unified addressing: not an allocation, so a host pointer; but not a partial overlap. */
        CUdeviceptr base;
        size_t size;
        if (cuMemGetAddressRange_v2(&base, &size, p) == CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
        return CUDA_SUCCESS;
    }
    return rc;
}

/* dst/src: device pointers (0 when the host side is used); mode_*: how to check them. */
static CUresult copy(CUdeviceptr dst, void *dst_host, CUdeviceptr src, const void *src_host, size_t n, int mode_dst,
                     int mode_src, int async, CUstream h, int ptds) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if ((!dst && !dst_host) || (!src && !src_host)) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s;
    rc = sim_resolve_stream(async ? h : NULL, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (n == 0) return CUDA_SUCCESS;
    if (dst && (rc = check_ptr(dst, n, mode_dst)) != CUDA_SUCCESS) return rc;
    if (src && (rc = check_ptr(src, n, mode_src)) != CUDA_SUCCESS) return rc;
    if (async && s->capturing) {
        struct CUgraphNode_st node = {.type = NODE_MEMCPY,
                                      .dst = dst ? dst : (CUdeviceptr)(uintptr_t)dst_host,
                                      .src = src,
                                      .src_host = src_host,
                                      .bytes = n,
                                      .elem = dst ? 1 : 0 /* memcpy nodes: 1 = dst is device memory */};
        sim_capture_add(s, &node);
        return CUDA_SUCCESS;
    }
    if (!async) {
        if (s->capturing) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        sim_stream_drain(s);
    }
    return sim_copy_exec(dst, src_host, src, dst_host, n);
}

SIM_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    return copy(dstDevice, NULL, 0, srcHost, ByteCount, DEV_REQUIRED, 0, 0, NULL, 0);
}
SIM_EXPORT CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy(0, dstHost, srcDevice, NULL, ByteCount, 0, DEV_REQUIRED, 0, NULL, 0);
}
SIM_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy(dstDevice, NULL, srcDevice, NULL, ByteCount, DEV_REQUIRED, DEV_REQUIRED, 0, NULL, 0);
}
SIM_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                         CUstream hStream) {
    return copy(dstDevice, NULL, 0, srcHost, ByteCount, DEV_REQUIRED, 0, 1, hStream, 0);
}
SIM_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
    return copy(0, dstHost, srcDevice, NULL, ByteCount, 0, DEV_REQUIRED, 1, hStream, 0);
}
SIM_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                         CUstream hStream) {
    return copy(dstDevice, NULL, srcDevice, NULL, ByteCount, DEV_REQUIRED, DEV_REQUIRED, 1, hStream, 0);
}
SIM_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    return copy(dstDevice, NULL, 0, srcHost, ByteCount, DEV_REQUIRED, 0, 0, NULL, 1);
}
SIM_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy(0, dstHost, srcDevice, NULL, ByteCount, 0, DEV_REQUIRED, 0, NULL, 1);
}
SIM_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy(dstDevice, NULL, srcDevice, NULL, ByteCount, DEV_REQUIRED, DEV_REQUIRED, 0, NULL, 1);
}
SIM_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                              CUstream hStream) {
    return copy(dstDevice, NULL, 0, srcHost, ByteCount, DEV_REQUIRED, 0, 1, hStream, 1);
}
SIM_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                              CUstream hStream) {
    return copy(0, dstHost, srcDevice, NULL, ByteCount, 0, DEV_REQUIRED, 1, hStream, 1);
}
SIM_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                              CUstream hStream) {
    return copy(dstDevice, NULL, srcDevice, NULL, ByteCount, DEV_REQUIRED, DEV_REQUIRED, 1, hStream, 1);
}
SIM_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    return copy(dst, NULL, src, NULL, ByteCount, DEV_OR_HOST, DEV_OR_HOST, 0, NULL, 0);
}
SIM_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    return copy(dst, NULL, src, NULL, ByteCount, DEV_OR_HOST, DEV_OR_HOST, 0, NULL, 1);
}
SIM_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
    return copy(dst, NULL, src, NULL, ByteCount, DEV_OR_HOST, DEV_OR_HOST, 1, hStream, 0);
}
SIM_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
    return copy(dst, NULL, src, NULL, ByteCount, DEV_OR_HOST, DEV_OR_HOST, 1, hStream, 1);
}

/* Legacy 32-bit forms. */
SIM_EXPORT CUresult cuMemcpyHtoD(CUdeviceptr_v1 dstDevice, const void *srcHost, unsigned int ByteCount) {
    return cuMemcpyHtoD_v2(dstDevice, srcHost, ByteCount);
}
SIM_EXPORT CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr_v1 srcDevice, unsigned int ByteCount) {
    return cuMemcpyDtoH_v2(dstHost, srcDevice, ByteCount);
}
SIM_EXPORT CUresult cuMemcpyDtoD(CUdeviceptr_v1 dstDevice, CUdeviceptr_v1 srcDevice, unsigned int ByteCount) {
    return cuMemcpyDtoD_v2(dstDevice, srcDevice, ByteCount);
}
SIM_EXPORT CUresult cuMemcpyHtoDAsync(CUdeviceptr_v1 dstDevice, const void *srcHost, unsigned int ByteCount,
                                      CUstream hStream) {
    return cuMemcpyHtoDAsync_v2(dstDevice, srcHost, ByteCount, hStream);
}
SIM_EXPORT CUresult cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr_v1 srcDevice, unsigned int ByteCount,
                                      CUstream hStream) {
    return cuMemcpyDtoHAsync_v2(dstHost, srcDevice, ByteCount, hStream);
}
SIM_EXPORT CUresult cuMemcpyDtoDAsync(CUdeviceptr_v1 dstDevice, CUdeviceptr_v1 srcDevice, unsigned int ByteCount,
                                      CUstream hStream) {
    return cuMemcpyDtoDAsync_v2(dstDevice, srcDevice, ByteCount, hStream);
}

static CUresult memset_(CUdeviceptr dst, unsigned value, size_t n, int elem, int async, CUstream h, int ptds) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    struct CUstream_st *s;
    rc = sim_resolve_stream(async ? h : NULL, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (elem == 4 && (dst & 3)) return CUDA_ERROR_INVALID_VALUE; /* 32-bit memset needs a 4-byte aligned pointer */
    if (n == 0) return CUDA_SUCCESS;
    if (n > SIZE_MAX / (size_t)elem) return CUDA_ERROR_INVALID_VALUE;
    if ((rc = check_ptr(dst, n * (size_t)elem, DEV_REQUIRED)) != CUDA_SUCCESS) return rc;
    if (async && s->capturing) {
        struct CUgraphNode_st node = {.type = NODE_MEMSET, .dst = dst, .bytes = n, .value = value, .elem = elem};
        sim_capture_add(s, &node);
        return CUDA_SUCCESS;
    }
    if (!async) {
        if (s->capturing) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        sim_stream_drain(s);
    }
    return sim_memset_exec(dst, value, n, elem);
}

SIM_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    return memset_(dstDevice, uc, N, 1, 0, NULL, 0);
}
SIM_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N) {
    return memset_(dstDevice, ui, N, 4, 0, NULL, 0);
}
SIM_EXPORT CUresult cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    return memset_(dstDevice, uc, N, 1, 0, NULL, 1);
}
SIM_EXPORT CUresult cuMemsetD32_v2_ptds(CUdeviceptr dstDevice, unsigned int ui, size_t N) {
    return memset_(dstDevice, ui, N, 4, 0, NULL, 1);
}
SIM_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
    return memset_(dstDevice, uc, N, 1, 1, hStream, 0);
}
SIM_EXPORT CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream) {
    return memset_(dstDevice, ui, N, 4, 1, hStream, 0);
}
SIM_EXPORT CUresult cuMemsetD8Async_ptsz(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
    return memset_(dstDevice, uc, N, 1, 1, hStream, 1);
}
SIM_EXPORT CUresult cuMemsetD32Async_ptsz(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream) {
    return memset_(dstDevice, ui, N, 4, 1, hStream, 1);
}
SIM_EXPORT CUresult cuMemsetD8(CUdeviceptr_v1 dstDevice, unsigned char uc, unsigned int N) {
    return cuMemsetD8_v2(dstDevice, uc, N);
}
SIM_EXPORT CUresult cuMemsetD32(CUdeviceptr_v1 dstDevice, unsigned int ui, unsigned int N) {
    return cuMemsetD32_v2(dstDevice, ui, N);
}

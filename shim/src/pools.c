/*
 * Stream-ordered allocation (cuMemAllocAsync, cuMemAllocFromPoolAsync and their _ptsz forms).
 * Charged by allocation and returned at cuMemFreeAsync, never by a pool's high-water mark: memory
 * a pool keeps cached after a free does not count against the slice, so a pool that once held
 * 3 GiB does not refuse the next allocation (the spurious OOM of the field).
 * The device of a pool allocation is the pool's (recorded when the pool is created or looked
 * up); of cuMemAllocAsync, the current context's.
 */
#include "shim_internal.h"

static int pool_device(CUmemoryPool pool) {
    int dev;
    if (pool != NULL && vgpu_track_find(VGPU_TRACK_POOL, (uint64_t)(uintptr_t)pool, &dev, NULL)) return dev;
    return vgpu_current_device_index();
}

static void remember_pool(CUmemoryPool pool, int dev) {
    int known;
    if (pool == NULL || dev < 0) return;
    if (!vgpu_track_find(VGPU_TRACK_POOL, (uint64_t)(uintptr_t)pool, &known, NULL))
        vgpu_track_add(VGPU_TRACK_POOL, (uint64_t)(uintptr_t)pool, dev, 0);
}

typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*alloc_pool_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);

static CUresult charged(int dev, CUdeviceptr *dptr, size_t bytesize, alloc_async_fn a, alloc_pool_fn ap,
                        CUmemoryPool pool, CUstream s) {
    uint64_t charge = vgpu_mem_round(bytesize);
    CUresult st = vgpu_mem_reserve(dev, charge);
    if (st != CUDA_SUCCESS) return st;
    CUresult rc = a ? a(dptr, bytesize, s) : ap(dptr, bytesize, pool, s);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, charge);
        return rc;
    }
    if (vgpu_track_add(VGPU_TRACK_PTR, *dptr, dev, charge) != 0) {
        real_cuMemFreeAsync(*dptr, s);
        vgpu_mem_release(dev, charge);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

static CUresult alloc_async(alloc_async_fn real, CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    if (!vgpu_mem_active() || dptr == NULL || bytesize == 0 || (dev = vgpu_current_device_index()) < 0)
        return real(dptr, bytesize, s);
    return charged(dev, dptr, bytesize, real, NULL, NULL, s);
}

static CUresult alloc_pool(alloc_pool_fn real, CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    if (!vgpu_mem_active() || dptr == NULL || bytesize == 0 || pool == NULL || (dev = pool_device(pool)) < 0)
        return real(dptr, bytesize, pool, s);
    return charged(dev, dptr, bytesize, NULL, real, pool, s);
}

static CUresult free_async(free_async_fn real, CUdeviceptr dptr, CUstream s) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    uint64_t bytes;
    if (!vgpu_mem_active() || !vgpu_track_take(VGPU_TRACK_PTR, dptr, &dev, &bytes)) return real(dptr, s);
    CUresult rc = real(dptr, s);
    if (rc == CUDA_SUCCESS) vgpu_mem_release(dev, bytes);
    else vgpu_track_add(VGPU_TRACK_PTR, dptr, dev, bytes);
    return rc;
}

CUresult hook_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async(real_cuMemAllocAsync, dptr, bytesize, hStream);
}
CUresult hook_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async(real_cuMemAllocAsync_ptsz, dptr, bytesize, hStream);
}
CUresult hook_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    return alloc_pool(real_cuMemAllocFromPoolAsync, dptr, bytesize, pool, hStream);
}
CUresult hook_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    return alloc_pool(real_cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, hStream);
}
CUresult hook_cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { return free_async(real_cuMemFreeAsync, dptr, hStream); }
CUresult hook_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    return free_async(real_cuMemFreeAsync_ptsz, dptr, hStream);
}

/* ---- pools: only to learn each pool's device ---- */

CUresult hook_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemPoolCreate == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real_cuMemPoolCreate(pool, poolProps);
    if (rc == CUDA_SUCCESS && vgpu_mem_active() && pool != NULL && poolProps != NULL &&
        poolProps->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        remember_pool(*pool, vgpu_device_index(poolProps->location.id));
    return rc;
}

CUresult hook_cuMemPoolDestroy(CUmemoryPool pool) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemPoolDestroy == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real_cuMemPoolDestroy(pool);
    if (rc == CUDA_SUCCESS && vgpu_mem_active()) vgpu_track_take(VGPU_TRACK_POOL, (uint64_t)(uintptr_t)pool, NULL, NULL);
    return rc;
}

/* Trimming returns cached memory the slice was never charged for: nothing to account. */
CUresult hook_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemPoolTrimTo == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    return real_cuMemPoolTrimTo(pool, minBytesToKeep);
}

CUresult hook_cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuDeviceGetDefaultMemPool == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real_cuDeviceGetDefaultMemPool(pool_out, dev);
    if (rc == CUDA_SUCCESS && pool_out != NULL && vgpu_mem_active()) remember_pool(*pool_out, vgpu_device_index(dev));
    return rc;
}

CUresult hook_cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuDeviceGetMemPool == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real_cuDeviceGetMemPool(pool, dev);
    if (rc == CUDA_SUCCESS && pool != NULL && vgpu_mem_active()) remember_pool(*pool, vgpu_device_index(dev));
    return rc;
}

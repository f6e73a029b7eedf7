/*
 * Virtual memory management: physical memory is taken by cuMemCreate (device-located handles)
 * and given back by cuMemRelease. Mapping and unmapping move no memory, so they are not hooked.
 * A handle takes its size in whole units of the granularity the driver reports for its
 * properties (cuMemGetAllocationGranularity, minimum; the driver refuses other sizes, so this
 * is the size itself whenever the driver accepts it).
 */
#include "shim_internal.h"

typedef CUresult (*gran_fn)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);

static uint64_t handle_bytes(uint64_t size, const CUmemAllocationProp *prop) {
    static gran_fn gran;
    if (gran == NULL) gran = (gran_fn)vgpu_cuda_sym("cuMemGetAllocationGranularity");
    size_t g = 0;
    if (gran == NULL || gran(&g, prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || g <= 1) return size;
    return size > UINT64_MAX - (g - 1) ? UINT64_MAX : (size + g - 1) / g * g;
}

CUresult hook_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                          unsigned long long flags) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemCreate == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    /* prop is read only when non-NULL; the device comes from the request itself, never from
     * uninitialised state (the NCCL/vLLM crash of the field) */
    if (!vgpu_mem_active() || handle == NULL || prop == NULL || size == 0 ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || (dev = vgpu_device_index(prop->location.id)) == -1)
        return real_cuMemCreate(handle, size, prop, flags);
    if (dev == VGPU_DEVICE_UNACCOUNTED)
        return (st = vgpu_mem_unaccounted()) != CUDA_SUCCESS ? st : real_cuMemCreate(handle, size, prop, flags);
    uint64_t charge = handle_bytes(size, prop);
    if ((st = vgpu_mem_reserve(dev, charge)) != CUDA_SUCCESS) return st;
    CUresult rc = real_cuMemCreate(handle, size, prop, flags);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, charge);
        return rc;
    }
    if (vgpu_track_add(VGPU_TRACK_HANDLE, *handle, dev, charge) != 0) {
        real_cuMemRelease(*handle);
        vgpu_mem_release(dev, charge);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

CUresult hook_cuMemRelease(CUmemGenericAllocationHandle handle) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemRelease == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    uint64_t bytes;
    if (!vgpu_mem_active() || !vgpu_track_take(VGPU_TRACK_HANDLE, handle, &dev, &bytes))
        return real_cuMemRelease(handle);
    CUresult rc = real_cuMemRelease(handle);
    if (rc == CUDA_SUCCESS)
        vgpu_mem_release(dev, bytes);
    else
        vgpu_track_add(VGPU_TRACK_HANDLE, handle, dev, bytes);
    return rc;
}

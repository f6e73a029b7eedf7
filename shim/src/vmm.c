/*
 * Virtual memory management: physical memory is taken by cuMemCreate (device-located handles)
 * and given back by cuMemRelease. Mapping and unmapping move no memory, so they are not hooked.
 * A handle takes its size in whole units of the granularity the driver reports for its
 * properties (cuMemGetAllocationGranularity, minimum; the driver refuses other sizes, so this
 * is the size itself whenever the driver accepts it).
 * A handle is counted by the driver: cuMemRetainAllocationHandle (the handle of a mapped address)
 * adds a reference that a cuMemRelease drops, and the memory goes only at the last release. So
 * the shim counts the retains of each handle it charged (the record's aux word) and returns the
 * charge at the release that drops the last reference.
 */
#include <pthread.h>

#include "devices.h"
#include "hooks.h"
#include "init.h"
#include "log.h"
#include "reserve.h"
#include "symbols.h"
#include "track.h"

/* A retain or release of a charged handle and its record change together: a release racing a
 * retain must not see the driver's count and ours disagree. */
static pthread_mutex_t handles_mu = PTHREAD_MUTEX_INITIALIZER;

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
    VGPU_HOOK_OPEN(real_cuMemCreate);
    CUresult st;
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
    VGPU_HOOK_OPEN(real_cuMemRelease);
    if (!vgpu_mem_active()) return real_cuMemRelease(handle);
    int dev;
    uint64_t bytes, retains;
    pthread_mutex_lock(&handles_mu);
    if (!vgpu_track_take_aux(VGPU_TRACK_HANDLE, handle, &dev, &bytes, &retains)) {
        pthread_mutex_unlock(&handles_mu);
        return real_cuMemRelease(handle);
    }
    CUresult rc = real_cuMemRelease(handle);
    if (rc == CUDA_SUCCESS && retains == 0) {
        vgpu_mem_release(dev, bytes); /* the last reference: the memory is gone */
    } else {
        /* still referenced (or not released): the record stays, one retain fewer on success;
         * the node just taken is reused, so this cannot fail for want of memory */
        vgpu_track_add_aux(VGPU_TRACK_HANDLE, handle, dev, bytes, rc == CUDA_SUCCESS ? retains - 1 : retains);
    }
    pthread_mutex_unlock(&handles_mu);
    return rc;
}

CUresult hook_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    VGPU_HOOK_OPEN(real_cuMemRetainAllocationHandle);
    if (!vgpu_mem_active() || handle == NULL) return real_cuMemRetainAllocationHandle(handle, addr);
    pthread_mutex_lock(&handles_mu);
    CUresult rc = real_cuMemRetainAllocationHandle(handle, addr);
    int dev;
    uint64_t bytes, retains;
    if (rc == CUDA_SUCCESS && vgpu_track_take_aux(VGPU_TRACK_HANDLE, *handle, &dev, &bytes, &retains))
        vgpu_track_add_aux(VGPU_TRACK_HANDLE, *handle, dev, bytes, retains + 1);
    pthread_mutex_unlock(&handles_mu);
    return rc;
}

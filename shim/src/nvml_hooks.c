/*
 * NVML memory reporting: nvidia-smi and monitoring in the container see the slice (total =
 * quota, used = the slice's usage, free = the rest), like cuMemGetInfo. NVML is resolved lazily
 * at the first of these calls: a process with only libcuda.so.1 never needs it, and a process
 * that only uses NVML (no CUDA context) still gets the slice's view, since the region does not
 * need CUDA.
 */
#include "shim_internal.h"

static int slice_of(nvmlDevice_t device, uint64_t drv_total, uint64_t *total, uint64_t *used, uint64_t *free_out) {
    if (vgpu_init() != CUDA_SUCCESS || !vgpu_mem_active()) return 0;
    int idx = vgpu_nvml_device_index(device);
    if (idx < 0) return 0;
    uint64_t limit = vgpu_region_limit(idx);
    if (limit == 0) return 0;
    vgpu_region_reclaim_dead();
    uint64_t u = vgpu_region_used(idx);
    uint64_t t = limit < drv_total ? limit : drv_total;
    *total = t;
    *used = u < t ? u : t;
    *free_out = t - *used; /* never negative, never wrapped */
    return 1;
}

nvmlReturn_t hook_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (vgpu_resolve_nvml() != 0 || real_nvmlDeviceGetMemoryInfo == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo(device, memory);
    uint64_t t, u, f;
    if (rc == NVML_SUCCESS && memory != NULL && slice_of(device, memory->total, &t, &u, &f)) {
        memory->total = t;
        memory->used = u;
        memory->free = f;
    }
    return rc;
}

nvmlReturn_t hook_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (vgpu_resolve_nvml() != 0 || real_nvmlDeviceGetMemoryInfo_v2 == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo_v2(device, memory);
    uint64_t t, u, f;
    if (rc == NVML_SUCCESS && memory != NULL && slice_of(device, memory->total, &t, &u, &f)) {
        memory->total = t;
        memory->reserved = 0; /* the driver's reservation is not the slice's */
        memory->used = u;
        memory->free = f;
    }
    return rc;
}

/*
 * NVML memory reporting: nvidia-smi and monitoring in the container see the slice (total =
 * quota, used = the slice's usage, free = the rest), like cuMemGetInfo. NVML is resolved lazily
 * at the first of these calls: a process with only libcuda.so.1 never needs it, and a process
 * that only uses NVML (no CUDA context) still gets the slice's view, since the region does not
 * need CUDA.
 */
#include "devices.h"
#include "hooks.h"
#include "init.h"
#include "region.h"
#include "reserve.h"
#include "symbols.h"

static int slice_of(nvmlDevice_t device, uint64_t drv_total, uint64_t *total, uint64_t *used, uint64_t *free_out) {
    if (vgpu_init() != CUDA_SUCCESS || !vgpu_mem_active()) return 0;
    int idx = vgpu_nvml_device_index(device);
    if (idx < 0) return 0;
    uint64_t limit = vgpu_mem_shown_total(idx), allowed = vgpu_mem_allowed_now(idx);
    if (limit == 0) return 0;
    vgpu_region_reclaim_dead();
    uint64_t u = vgpu_region_used(idx);
    uint64_t t = limit < drv_total ? limit : drv_total;
    *total = t;
    *used = u < t ? u : t;
    uint64_t f = u >= allowed ? 0 : allowed - u; /* never negative, never wrapped */
    *free_out = f < t - *used ? f : t - *used;
    return 1;
}

/* nvmlDeviceGetMemoryInfo and its _v2 differ only in the struct they fill (nvmlMemory_t,
 * nvmlMemory_v2_t): one helper, and per version an adapter calling the real function (NOT_FOUND
 * when the driver lacks it) and one writing the slice's view into that version's struct. */
struct memory_abi {
    nvmlReturn_t (*call)(nvmlDevice_t device, void *memory);
    uint64_t (*total)(const void *memory);
    void (*set)(void *memory, uint64_t total, uint64_t used, uint64_t free);
};

static nvmlReturn_t memory_info(const struct memory_abi *abi, nvmlDevice_t device, void *memory) {
    if (vgpu_resolve_nvml() != 0) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = abi->call(device, memory);
    uint64_t t, u, f;
    if (rc == NVML_SUCCESS && memory != NULL && slice_of(device, abi->total(memory), &t, &u, &f))
        abi->set(memory, t, u, f);
    return rc;
}

static nvmlReturn_t call_v1(nvmlDevice_t device, void *memory) {
    if (real_nvmlDeviceGetMemoryInfo == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return real_nvmlDeviceGetMemoryInfo(device, (nvmlMemory_t *)memory);
}
static nvmlReturn_t call_v2(nvmlDevice_t device, void *memory) {
    if (real_nvmlDeviceGetMemoryInfo_v2 == NULL) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return real_nvmlDeviceGetMemoryInfo_v2(device, (nvmlMemory_v2_t *)memory);
}
static uint64_t total_v1(const void *memory) { return ((const nvmlMemory_t *)memory)->total; }
static uint64_t total_v2(const void *memory) { return ((const nvmlMemory_v2_t *)memory)->total; }
static void set_v1(void *memory, uint64_t total, uint64_t used, uint64_t free) {
    nvmlMemory_t *m = memory;
    m->total = total;
    m->used = used;
    m->free = free;
}
static void set_v2(void *memory, uint64_t total, uint64_t used, uint64_t free) {
    nvmlMemory_v2_t *m = memory;
    m->total = total;
    m->reserved = 0; /* the driver's reservation is not the slice's */
    m->used = used;
    m->free = free;
}
static const struct memory_abi MEMORY_V1 = {call_v1, total_v1, set_v1}, MEMORY_V2 = {call_v2, total_v2, set_v2};

nvmlReturn_t hook_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    return memory_info(&MEMORY_V1, device, memory);
}
nvmlReturn_t hook_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    return memory_info(&MEMORY_V2, device, memory);
}

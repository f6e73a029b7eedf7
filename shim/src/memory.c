/*
 * Linear device memory: cuMemAlloc*, cuMemAllocPitch*, cuMemAllocManaged, cuMemFree*, and what
 * the slice reports (cuMemGetInfo*, cuDeviceTotalMem*).
 *
 * Every allocation reserves its bytes in the region first and allocates second; a failed
 * allocation returns the reservation. There is no window in which two processes both see room
 * for the last bytes (no check-then-act race).
 */
#include <limits.h>
#include <stdatomic.h>

#include "shim_internal.h"

/* The driver takes whole granules: charge what it takes, not what was asked, or the slice
 * could overrun its quota by a fraction of a granule per allocation. */
#ifndef VGPU_ALLOC_GRANULE
#define VGPU_ALLOC_GRANULE 512ULL
#endif

/* Upper bound of the pitch alignment the driver may choose for cuMemAllocPitch: reserve with it,
 * then settle to the pitch actually returned. */
#define PITCH_ALIGN_BOUND 512ULL

uint64_t vgpu_mem_round(uint64_t n) {
    if (n > UINT64_MAX - (VGPU_ALLOC_GRANULE - 1)) return UINT64_MAX;
    return (n + VGPU_ALLOC_GRANULE - 1) / VGPU_ALLOC_GRANULE * VGPU_ALLOC_GRANULE;
}

static uint64_t mul_sat(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

int vgpu_mem_active(void) { return vgpu_region() != NULL && !vgpu_config()->disabled; }

CUresult vgpu_mem_reserve(int dev, uint64_t bytes) {
    uint64_t limit = vgpu_region_limit(dev), used = 0;
    int rc = vgpu_region_charge(dev, bytes, limit, &used);
    /* before refusing: memory our pools merely cache goes back to the device, then retry */
    if (rc == -1 && vgpu_pools_settle(dev, 1)) rc = vgpu_region_charge(dev, bytes, limit, &used);
    if (rc == 0) return CUDA_SUCCESS;
    if (rc == -2) return CUDA_ERROR_OPERATING_SYSTEM; /* region unusable: reported already */
    static atomic_flag said = ATOMIC_FLAG_INIT;
    if (!atomic_flag_test_and_set(&said)) {
        char want[32], u[32], l[32];
        vgpu_format_bytes(bytes, want, sizeof want);
        vgpu_format_bytes(used, u, sizeof u);
        vgpu_format_bytes(limit, l, sizeof l);
        vgpu_log(VGPU_LOG_WARN, "device %d: %s denied, slice uses %s of %s", dev, want, u, l);
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

void vgpu_mem_release(int dev, uint64_t bytes) { vgpu_region_uncharge(dev, bytes); }

/* Record a successful allocation; if even that fails (out of host memory), undo it all. */
static CUresult record(int kind, uint64_t key, int dev, uint64_t bytes, CUresult (*undo)(uint64_t)) {
    if (vgpu_track_add(kind, key, dev, bytes) == 0) return CUDA_SUCCESS;
    undo(key);
    vgpu_mem_release(dev, bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult undo_free_v2(uint64_t p) { return real_cuMemFree_v2((CUdeviceptr)p); }
static CUresult undo_free_v1(uint64_t p) { return real_cuMemFree((CUdeviceptr_v1)p); }

/* ---- cuMemAlloc ---- */

CUresult hook_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemAlloc_v2 == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    /* NULL pointer, zero size, no context: the driver's error, not ours */
    if (!vgpu_mem_active() || dptr == NULL || bytesize == 0 || (dev = vgpu_current_device_index()) < 0)
        return real_cuMemAlloc_v2(dptr, bytesize);
    uint64_t charge = vgpu_mem_round(bytesize);
    if ((st = vgpu_mem_reserve(dev, charge)) != CUDA_SUCCESS) return st;
    CUresult rc = real_cuMemAlloc_v2(dptr, bytesize);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, charge);
        return rc;
    }
    return record(VGPU_TRACK_PTR, *dptr, dev, charge, undo_free_v2);
}

CUresult hook_cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemAlloc == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    if (!vgpu_mem_active() || dptr == NULL || bytesize == 0 || (dev = vgpu_current_device_index()) < 0)
        return real_cuMemAlloc(dptr, bytesize);
    uint64_t charge = vgpu_mem_round(bytesize);
    if ((st = vgpu_mem_reserve(dev, charge)) != CUDA_SUCCESS) return st;
    CUresult rc = real_cuMemAlloc(dptr, bytesize);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, charge);
        return rc;
    }
    return record(VGPU_TRACK_PTR, *dptr, dev, charge, undo_free_v1);
}

CUresult hook_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemAllocManaged == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    /* Managed memory can live on the device: it is charged to the current context's device. */
    if (!vgpu_mem_active() || dptr == NULL || bytesize == 0 || (dev = vgpu_current_device_index()) < 0)
        return real_cuMemAllocManaged(dptr, bytesize, flags);
    uint64_t charge = vgpu_mem_round(bytesize);
    if ((st = vgpu_mem_reserve(dev, charge)) != CUDA_SUCCESS) return st;
    CUresult rc = real_cuMemAllocManaged(dptr, bytesize, flags);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, charge);
        return rc;
    }
    return record(VGPU_TRACK_PTR, *dptr, dev, charge, undo_free_v2);
}

/* ---- cuMemAllocPitch: reserve an upper bound, settle to the pitch the driver chose ---- */

static CUresult settle(int dev, uint64_t reserved, uint64_t actual) {
    if (actual > reserved) return vgpu_mem_reserve(dev, actual - reserved);
    if (actual < reserved) vgpu_mem_release(dev, reserved - actual);
    return CUDA_SUCCESS;
}

CUresult hook_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                 unsigned int ElementSizeBytes) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemAllocPitch_v2 == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    if (!vgpu_mem_active() || dptr == NULL || pPitch == NULL || WidthInBytes == 0 || Height == 0 ||
        (dev = vgpu_current_device_index()) < 0)
        return real_cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    uint64_t w = WidthInBytes > UINT64_MAX - PITCH_ALIGN_BOUND ? UINT64_MAX
                                                               : (WidthInBytes + PITCH_ALIGN_BOUND - 1) / PITCH_ALIGN_BOUND * PITCH_ALIGN_BOUND;
    uint64_t reserved = vgpu_mem_round(mul_sat(w, Height));
    if ((st = vgpu_mem_reserve(dev, reserved)) != CUDA_SUCCESS) return st;
    CUresult rc = real_cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, reserved);
        return rc;
    }
    uint64_t actual = vgpu_mem_round(mul_sat(*pPitch, Height));
    if (settle(dev, reserved, actual) != CUDA_SUCCESS) { /* a pitch beyond our bound, over quota */
        real_cuMemFree_v2(*dptr);
        vgpu_mem_release(dev, reserved);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return record(VGPU_TRACK_PTR, *dptr, dev, actual, undo_free_v2);
}

CUresult hook_cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                              unsigned int Height, unsigned int ElementSizeBytes) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemAllocPitch == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    if (!vgpu_mem_active() || dptr == NULL || pPitch == NULL || WidthInBytes == 0 || Height == 0 ||
        (dev = vgpu_current_device_index()) < 0)
        return real_cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    uint64_t w = ((uint64_t)WidthInBytes + PITCH_ALIGN_BOUND - 1) / PITCH_ALIGN_BOUND * PITCH_ALIGN_BOUND;
    uint64_t reserved = vgpu_mem_round(w * Height);
    if ((st = vgpu_mem_reserve(dev, reserved)) != CUDA_SUCCESS) return st;
    CUresult rc = real_cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, reserved);
        return rc;
    }
    uint64_t actual = vgpu_mem_round((uint64_t)*pPitch * Height);
    if (settle(dev, reserved, actual) != CUDA_SUCCESS) {
        real_cuMemFree(*dptr);
        vgpu_mem_release(dev, reserved);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return record(VGPU_TRACK_PTR, *dptr, dev, actual, undo_free_v1);
}

/* ---- cuMemFree: take the record first (so a concurrent allocation reusing the address cannot
 * be confused with this one), free, and put it back if the driver refused ---- */

CUresult hook_cuMemFree_v2(CUdeviceptr dptr) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemFree_v2 == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    uint64_t bytes;
    if (!vgpu_mem_active()) return real_cuMemFree_v2(dptr);
    /* cuMemFree also frees stream-ordered allocations (after synchronising) */
    if (!vgpu_track_take(VGPU_TRACK_PTR, dptr, &dev, &bytes)) return vgpu_pools_free_sync(dptr, real_cuMemFree_v2);
    CUresult rc = real_cuMemFree_v2(dptr);
    if (rc == CUDA_SUCCESS) vgpu_mem_release(dev, bytes);
    else vgpu_track_add(VGPU_TRACK_PTR, dptr, dev, bytes);
    return rc;
}

CUresult hook_cuMemFree(CUdeviceptr_v1 dptr) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemFree == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    uint64_t bytes;
    if (!vgpu_mem_active() || !vgpu_track_take(VGPU_TRACK_PTR, dptr, &dev, &bytes)) return real_cuMemFree(dptr);
    CUresult rc = real_cuMemFree(dptr);
    if (rc == CUDA_SUCCESS) vgpu_mem_release(dev, bytes);
    else vgpu_track_add(VGPU_TRACK_PTR, dptr, dev, bytes);
    return rc;
}

/* ---- reporting: the slice, not the GPU ---- */

/* The slice's (total, free) for device index dev given the driver's view; 0 if unlimited. */
static int slice_view(int dev, uint64_t drv_total, uint64_t drv_free, uint64_t *total, uint64_t *free_out) {
    uint64_t limit = vgpu_region_limit(dev);
    if (limit == 0) return 0;
    vgpu_region_reclaim_dead(); /* what dead processes held is free again */
    vgpu_pools_settle(dev, 0);  /* pools that released cached memory at a synchronisation */
    uint64_t used = vgpu_region_used(dev);
    uint64_t t = limit < drv_total ? limit : drv_total;
    uint64_t f = used >= limit ? 0 : limit - used; /* never negative, never wrapped */
    if (f > drv_free) f = drv_free; /* the GPU itself may have less left (other tenants) */
    if (f > t) f = t;
    *total = t;
    *free_out = f;
    return 1;
}

CUresult hook_cuMemGetInfo_v2(size_t *free, size_t *total) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemGetInfo_v2 == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real_cuMemGetInfo_v2(free, total);
    int dev;
    if (rc != CUDA_SUCCESS || free == NULL || total == NULL || !vgpu_mem_active() || (dev = vgpu_current_device_index()) < 0)
        return rc;
    uint64_t t, f;
    if (slice_view(dev, *total, *free, &t, &f)) {
        *total = t;
        *free = f;
    }
    return rc;
}

CUresult hook_cuMemGetInfo(unsigned int *free, unsigned int *total) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemGetInfo == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real_cuMemGetInfo(free, total);
    int dev;
    if (rc != CUDA_SUCCESS || free == NULL || total == NULL || !vgpu_mem_active() || (dev = vgpu_current_device_index()) < 0)
        return rc;
    uint64_t t, f;
    if (slice_view(dev, *total, *free, &t, &f)) {
        *total = (unsigned int)(t > UINT_MAX ? UINT_MAX : t);
        *free = (unsigned int)(f > UINT_MAX ? UINT_MAX : f);
    }
    return rc;
}

CUresult hook_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuDeviceTotalMem_v2 == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real_cuDeviceTotalMem_v2(bytes, dev);
    int idx;
    if (rc != CUDA_SUCCESS || bytes == NULL || !vgpu_mem_active() || (idx = vgpu_device_index(dev)) < 0) return rc;
    uint64_t limit = vgpu_region_limit(idx);
    if (limit != 0 && limit < *bytes) *bytes = limit;
    return rc;
}

CUresult hook_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuDeviceTotalMem == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real_cuDeviceTotalMem(bytes, dev);
    int idx;
    if (rc != CUDA_SUCCESS || bytes == NULL || !vgpu_mem_active() || (idx = vgpu_device_index(dev)) < 0) return rc;
    uint64_t limit = vgpu_region_limit(idx);
    if (limit != 0 && limit < *bytes) *bytes = (unsigned int)limit;
    return rc;
}

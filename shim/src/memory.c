/*
 * Linear device memory: cuMemAlloc*, cuMemAllocPitch*, cuMemAllocManaged, cuMemFree*, and what
 * the slice reports (cuMemGetInfo*, cuDeviceTotalMem*).
 *
 * Every allocation reserves its bytes in the region first and allocates second; a failed
 * allocation returns the reservation. There is no window in which two processes both see room
 * for the last bytes (no check-then-act race).
 *
 * What an allocation takes is reserve.c's to say (the driver's page and alignment, learned).
 * cuMemAllocPitch: the row pitch is the driver's choice; the allocation is reserved for the pitch
 * the driver is expected to choose, and settled to the pitch it returned if that differs.
 */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>

#include "context.h"
#include "devices.h"
#include "hooks.h"
#include "init.h"
#include "pools.h"
#include "region.h"
#include "reserve.h"
#include "symbols.h"
#include "track.h"

static uint64_t mul_sat(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

/* Record a successful allocation (its charge, or its sub-allocated unit in aux); if even that
 * fails (out of host memory), undo it all. */
static CUresult record(int kind, uint64_t key, int dev, uint64_t bytes, uint64_t unit, CUresult (*undo)(uint64_t)) {
    if (vgpu_track_add_aux(kind, key, dev, bytes, unit) == 0) return CUDA_SUCCESS;
    undo(key);
    vgpu_mem_give_back(dev, bytes, unit);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* ---- the ABI twins ----
 * cuMemAlloc, cuMemAllocPitch, cuMemFree, cuMemGetInfo and cuDeviceTotalMem each have a v1 (32-bit
 * pointers and sizes, cuda.h before 3.2) and a v2 (64-bit) entry point. Each pair shares one
 * helper, written in 64 bits; a small adapter per version calls that version's real function with
 * the caller's own out-parameters (the driver writes them exactly as without the shim) and widens
 * what it wrote. Only what a v1 caller reads back is narrowed, and it fits: a v1 pointer or pitch
 * is the driver's own 32-bit answer, a v1 size is clamped (never wrapped). The real function is
 * read through the adapter after vgpu_init() has resolved it, never before. */

#define PRESENT(sym)                                                                                                   \
    static int has_##sym(void) { return real_##sym != NULL; }

/* cuMemAlloc-like: out is the caller's CUdeviceptr * (v1: CUdeviceptr_v1 *); size and flags are
 * the caller's, widened. */
struct alloc_abi {
    int (*has)(void);
    CUresult (*call)(void *out, uint64_t size, unsigned int flags);
    uint64_t (*got)(const void *out); /* the pointer the driver stored, widened */
    CUresult (*undo)(uint64_t p);     /* the matching free */
};

static CUresult undo_free_v2(uint64_t p) { return real_cuMemFree_v2((CUdeviceptr)p); }
static CUresult undo_free_v1(uint64_t p) { return real_cuMemFree((CUdeviceptr_v1)p); }
static uint64_t got_v2(const void *out) { return *(const CUdeviceptr *)out; }
static uint64_t got_v1(const void *out) { return *(const CUdeviceptr_v1 *)out; }

/* Take, allocate, record (or give back). NULL pointer, zero size, no context: the driver's error,
 * not ours. */
static CUresult mem_alloc(const struct alloc_abi *abi, void *out, uint64_t size, unsigned int flags) {
    VGPU_HOOK_OPEN(abi->has());
    CUresult st;
    int dev;
    if (!vgpu_mem_active() || out == NULL || size == 0 || (dev = vgpu_current_device_index()) == -1)
        return abi->call(out, size, flags);
    if (dev == VGPU_DEVICE_UNACCOUNTED)
        return (st = vgpu_mem_unaccounted()) != CUDA_SUCCESS ? st : abi->call(out, size, flags);
    uint64_t charged, unit;
    if ((st = vgpu_mem_take(dev, size, &charged, &unit)) != CUDA_SUCCESS) return st;
    CUresult rc = abi->call(out, size, flags);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_give_back(dev, charged, unit);
        return rc;
    }
    return record(VGPU_TRACK_PTR, abi->got(out), dev, charged, unit, abi->undo);
}

PRESENT(cuMemAlloc_v2)
PRESENT(cuMemAlloc)
PRESENT(cuMemAllocManaged)
static CUresult alloc_v2(void *out, uint64_t size, unsigned int flags) {
    return real_cuMemAlloc_v2((CUdeviceptr *)out, (size_t)size);
}
/* size came from the v1 caller's unsigned int: narrowing it back is exact */
static CUresult alloc_v1(void *out, uint64_t size, unsigned int flags) {
    return real_cuMemAlloc((CUdeviceptr_v1 *)out, (unsigned int)size);
}
static CUresult alloc_managed(void *out, uint64_t size, unsigned int flags) {
    return real_cuMemAllocManaged((CUdeviceptr *)out, (size_t)size, flags);
}
static const struct alloc_abi ALLOC_V2 = {has_cuMemAlloc_v2, alloc_v2, got_v2, undo_free_v2};
static const struct alloc_abi ALLOC_V1 = {has_cuMemAlloc, alloc_v1, got_v1, undo_free_v1};
/* Managed memory can live on the device: it is charged to the current context's device. */
static const struct alloc_abi ALLOC_MANAGED = {has_cuMemAllocManaged, alloc_managed, got_v2, undo_free_v2};

CUresult hook_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return mem_alloc(&ALLOC_V2, dptr, bytesize, 0); }
CUresult hook_cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize) {
    return mem_alloc(&ALLOC_V1, dptr, bytesize, 0);
}
CUresult hook_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    return mem_alloc(&ALLOC_MANAGED, dptr, bytesize, flags);
}

/* ---- cuMemAllocPitch: take for the pitch the driver is expected to choose (width rounded to
 * the pitch alignment P learned from its answers); if it chose another, take for that instead
 * and learn from it ---- */

/* out/pitch_out: the caller's CUdeviceptr * and size_t * (v1: CUdeviceptr_v1 * and unsigned int *) */
struct pitch_abi {
    int (*has)(void);
    CUresult (*call)(void *out, void *pitch_out, uint64_t width, uint64_t height, unsigned int elem);
    uint64_t (*got)(const void *out);
    uint64_t (*got_pitch)(const void *pitch_out);
    CUresult (*undo)(uint64_t p);
};

static CUresult pitch_taken(int dev, uint64_t p, uint64_t pitch, uint64_t height, uint64_t expected_bytes,
                            uint64_t *charged, uint64_t *unit, CUresult (*undo)(uint64_t)) {
    uint64_t actual = mul_sat(pitch, height);
    if (actual == expected_bytes) return CUDA_SUCCESS;
    vgpu_mem_give_back(dev, *charged, *unit);
    if (vgpu_mem_take(dev, actual, charged, unit) == CUDA_SUCCESS) return CUDA_SUCCESS;
    undo(p); /* a wider pitch than expected, over quota */
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* width and height in 64 bits: a v1 pitch times height above 4 GiB is charged in full */
static CUresult mem_alloc_pitch(const struct pitch_abi *abi, void *out, void *pitch_out, uint64_t width,
                                uint64_t height, unsigned int elem) {
    VGPU_HOOK_OPEN(abi->has());
    CUresult st;
    int dev;
    if (!vgpu_mem_active() || out == NULL || pitch_out == NULL || width == 0 || height == 0 ||
        (dev = vgpu_current_device_index()) == -1)
        return abi->call(out, pitch_out, width, height, elem);
    if (dev == VGPU_DEVICE_UNACCOUNTED)
        return (st = vgpu_mem_unaccounted()) != CUDA_SUCCESS ? st : abi->call(out, pitch_out, width, height, elem);
    uint64_t expected = mul_sat(vgpu_mem_pitch_expected(dev, width), height), charged, unit;
    if ((st = vgpu_mem_take(dev, expected, &charged, &unit)) != CUDA_SUCCESS) return st;
    CUresult rc = abi->call(out, pitch_out, width, height, elem);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_give_back(dev, charged, unit);
        return rc;
    }
    uint64_t p = abi->got(out), pitch = abi->got_pitch(pitch_out);
    vgpu_mem_pitch_learn(dev, width, pitch);
    if ((rc = pitch_taken(dev, p, pitch, height, expected, &charged, &unit, abi->undo)) != CUDA_SUCCESS) return rc;
    return record(VGPU_TRACK_PTR, p, dev, charged, unit, abi->undo);
}

PRESENT(cuMemAllocPitch_v2)
PRESENT(cuMemAllocPitch)
static CUresult pitch_v2(void *out, void *pitch_out, uint64_t width, uint64_t height, unsigned int elem) {
    return real_cuMemAllocPitch_v2((CUdeviceptr *)out, (size_t *)pitch_out, (size_t)width, (size_t)height, elem);
}
/* width and height came from the v1 caller's unsigned ints: narrowing them back is exact */
static CUresult pitch_v1(void *out, void *pitch_out, uint64_t width, uint64_t height, unsigned int elem) {
    return real_cuMemAllocPitch((CUdeviceptr_v1 *)out, (unsigned int *)pitch_out, (unsigned int)width,
                                (unsigned int)height, elem);
}
static uint64_t got_pitch_v2(const void *pitch_out) { return *(const size_t *)pitch_out; }
static uint64_t got_pitch_v1(const void *pitch_out) { return *(const unsigned int *)pitch_out; }
static const struct pitch_abi PITCH_V2 = {has_cuMemAllocPitch_v2, pitch_v2, got_v2, got_pitch_v2, undo_free_v2};
static const struct pitch_abi PITCH_V1 = {has_cuMemAllocPitch, pitch_v1, got_v1, got_pitch_v1, undo_free_v1};

CUresult hook_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                 unsigned int ElementSizeBytes) {
    return mem_alloc_pitch(&PITCH_V2, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
}
CUresult hook_cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                              unsigned int Height, unsigned int ElementSizeBytes) {
    return mem_alloc_pitch(&PITCH_V1, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
}

/* ---- cuMemFree: take the record first (so a concurrent allocation reusing the address cannot
 * be confused with this one), free, and put it back if the driver refused ---- */

/* p: the caller's pointer, widened (a v1 pointer is its own 32-bit value, so narrowing is exact) */
static CUresult mem_free(int (*has)(void), CUresult (*real_free)(uint64_t), CUresult (*untracked)(uint64_t),
                         uint64_t p) {
    VGPU_HOOK_OPEN(has());
    int dev;
    uint64_t bytes, unit;
    if (!vgpu_mem_active()) return real_free(p);
    if (!vgpu_track_take_aux(VGPU_TRACK_PTR, p, &dev, &bytes, &unit)) return untracked(p);
    CUresult rc = real_free(p);
    if (rc == CUDA_SUCCESS)
        vgpu_mem_give_back(dev, bytes, unit);
    else
        vgpu_track_add_aux(VGPU_TRACK_PTR, p, dev, bytes, unit);
    return rc;
}

PRESENT(cuMemFree_v2)
PRESENT(cuMemFree)
/* cuMemFree_v2 also frees stream-ordered allocations (after synchronising); a v1 pointer cannot be
 * one (they are 64-bit only): it goes straight to the driver */
static CUresult free_untracked_v2(uint64_t p) { return vgpu_pools_free_sync((CUdeviceptr)p, real_cuMemFree_v2); }

CUresult hook_cuMemFree_v2(CUdeviceptr dptr) {
    return mem_free(has_cuMemFree_v2, undo_free_v2, free_untracked_v2, dptr);
}
CUresult hook_cuMemFree(CUdeviceptr_v1 dptr) { return mem_free(has_cuMemFree, undo_free_v1, undo_free_v1, dptr); }

/* ---- reporting: the slice, not the GPU ---- */

/* The slice's (total, free) for device index dev given the driver's view; 0 if unlimited. */
static int slice_view(int dev, uint64_t drv_total, uint64_t drv_free, uint64_t *total, uint64_t *free_out) {
    uint64_t limit = vgpu_mem_shown_total(dev), allowed = vgpu_mem_allowed_now(dev);
    if (limit == 0) return 0;
    vgpu_region_reclaim_dead(); /* what dead processes held is free again */
    vgpu_mem_settle(dev, 0);    /* caches that released cached memory at a synchronisation */
    uint64_t used = vgpu_region_used(dev);
    uint64_t t = limit < drv_total ? limit : drv_total;
    uint64_t f = used >= allowed ? 0 : allowed - used; /* never negative, never wrapped */
    if (f > drv_free) f = drv_free;                    /* the GPU itself may have less left (other tenants) */
    if (f > t) f = t;
    *total = t;
    *free_out = f;
    return 1;
}

/* A size the driver wrote to the caller's size_t * (v1: unsigned int *): read widened, and the
 * slice's view written back (clamped to what a v1 caller can hold, never wrapped). */
struct size_io {
    uint64_t (*get)(const void *a);
    void (*set)(void *a, uint64_t v);
};

static uint64_t get_v2(const void *a) { return *(const size_t *)a; }
static uint64_t get_v1(const void *a) { return *(const unsigned int *)a; }
static void set_v2(void *a, uint64_t v) { *(size_t *)a = (size_t)v; }
static void set_v1(void *a, uint64_t v) { *(unsigned int *)a = (unsigned int)(v > UINT_MAX ? UINT_MAX : v); }
static const struct size_io SIZE_V2 = {get_v2, set_v2}, SIZE_V1 = {get_v1, set_v1};

static CUresult mem_get_info(int (*has)(void), CUresult (*real)(void *, void *), const struct size_io *io, void *free,
                             void *total) {
    VGPU_HOOK_OPEN(has());
    CUresult rc = real(free, total);
    int dev;
    if (rc != CUDA_SUCCESS || free == NULL || total == NULL || !vgpu_mem_active() ||
        (dev = vgpu_current_device_index()) < 0)
        return rc;
    vgpu_primary_adopt(dev); /* the runtime's context is charged before free memory is shown */
    uint64_t t, f;
    if (slice_view(dev, io->get(total), io->get(free), &t, &f)) {
        io->set(total, t);
        io->set(free, f);
    }
    return rc;
}

/* The slice's limit when below the driver's total (so it fits wherever the driver's answer did) */
static CUresult device_total_mem(int (*has)(void), CUresult (*real)(void *, CUdevice), const struct size_io *io,
                                 void *bytes, CUdevice dev) {
    VGPU_HOOK_OPEN(has());
    CUresult rc = real(bytes, dev);
    int idx;
    if (rc != CUDA_SUCCESS || bytes == NULL || !vgpu_mem_active() || (idx = vgpu_device_index(dev)) < 0) return rc;
    uint64_t limit = vgpu_mem_shown_total(idx);
    if (limit != 0 && limit < io->get(bytes)) io->set(bytes, limit);
    return rc;
}

PRESENT(cuMemGetInfo_v2)
PRESENT(cuMemGetInfo)
PRESENT(cuDeviceTotalMem_v2)
PRESENT(cuDeviceTotalMem)
static CUresult info_v2(void *a, void *b) { return real_cuMemGetInfo_v2((size_t *)a, (size_t *)b); }
static CUresult info_v1(void *a, void *b) { return real_cuMemGetInfo((unsigned int *)a, (unsigned int *)b); }
static CUresult total_v2(void *a, CUdevice dev) { return real_cuDeviceTotalMem_v2((size_t *)a, dev); }
static CUresult total_v1(void *a, CUdevice dev) { return real_cuDeviceTotalMem((unsigned int *)a, dev); }

CUresult hook_cuMemGetInfo_v2(size_t *free, size_t *total) {
    return mem_get_info(has_cuMemGetInfo_v2, info_v2, &SIZE_V2, free, total);
}
CUresult hook_cuMemGetInfo(unsigned int *free, unsigned int *total) {
    return mem_get_info(has_cuMemGetInfo, info_v1, &SIZE_V1, free, total);
}
CUresult hook_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    return device_total_mem(has_cuDeviceTotalMem_v2, total_v2, &SIZE_V2, bytes, dev);
}
CUresult hook_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    return device_total_mem(has_cuDeviceTotalMem, total_v1, &SIZE_V1, bytes, dev);
}

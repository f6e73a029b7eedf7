/*
 * Linear device memory: cuMemAlloc*, cuMemAllocPitch*, cuMemAllocManaged, cuMemFree*, and what
 * the slice reports (cuMemGetInfo*, cuDeviceTotalMem*).
 *
 * Every allocation reserves its bytes in the region first and allocates second; a failed
 * allocation returns the reservation. There is no window in which two processes both see room
 * for the last bytes (no check-then-act race).
 *
 * What the driver takes is learned from the driver, per device, at the first allocation: its
 * page size G (cuMemGetAllocationGranularity, minimum) and its allocation alignment A
 * (CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT). As NVIDIA's driver allocates, an allocation of at
 * least G/2 takes whole pages of its own (charged its size rounded up to G) and a smaller one is
 * sub-allocated, in units of A, from pages the process's small allocations share: the process
 * is charged whole pages for them (a page more when their sum crosses a page boundary, a page
 * back when it falls below one). Where the driver does not answer, every allocation is charged
 * in whole pages of what it does report (never less than the driver takes).
 */
#include <limits.h>
#include <pthread.h>
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

/* ---- what the driver takes: learned per device ---- */

typedef CUresult (*gran_fn)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
typedef CUresult (*attr_fn)(int *, CUdevice_attribute, CUdevice);
typedef CUresult (*ctx_dev_fn)(CUdevice *);

static struct {
    pthread_mutex_t mu;
    uint64_t page, unit; /* G and A; 0 until learned */
    uint64_t small_live; /* bytes of the process's sub-allocated (small) allocations, in units */
} takes[VGPU_MAX_DEVICES];
static pthread_once_t takes_once = PTHREAD_ONCE_INIT;
static void takes_init(void) {
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) pthread_mutex_init(&takes[i].mu, NULL);
}

/* takes[dev].mu held: ask the driver for the current context's device (dev is its index) */
static void learn_locked(int dev) {
    if (takes[dev].page != 0) return;
    ctx_dev_fn ctx_dev = (ctx_dev_fn)vgpu_cuda_sym("cuCtxGetDevice");
    gran_fn gran = (gran_fn)vgpu_cuda_sym("cuMemGetAllocationGranularity");
    attr_fn attr = (attr_fn)vgpu_cuda_sym("cuDeviceGetAttribute");
    CUdevice d;
    size_t g = 0;
    int a = 0;
    if (ctx_dev == NULL || ctx_dev(&d) != CUDA_SUCCESS) return;
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = d;
    if (gran == NULL || gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) g = 0;
    if (attr == NULL || attr(&a, CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, d) != CUDA_SUCCESS) a = 0;
    if (g == 0 && a <= 0) return; /* nothing learned: ask again next time */
    /* one missing answer: the other one is used for both (whole units, never less than taken) */
    takes[dev].page = g ? g : (uint64_t)a;
    takes[dev].unit = a > 0 && (uint64_t)a <= takes[dev].page ? (uint64_t)a : takes[dev].page;
}

static uint64_t round_to(uint64_t n, uint64_t g) {
    if (g <= 1) return n;
    if (n > UINT64_MAX - (g - 1)) return UINT64_MAX;
    return (n + g - 1) / g * g;
}

static uint64_t pages_of(uint64_t bytes, uint64_t page) { return round_to(bytes, page) / page; }

/* Reserve what an allocation of `size` on device `dev` takes. *unit: its share of the shared
 * pages if it is sub-allocated (0 if it has pages of its own); *charged: bytes reserved now. */
static CUresult take(int dev, uint64_t size, uint64_t *charged, uint64_t *unit) {
    pthread_once(&takes_once, takes_init);
    pthread_mutex_lock(&takes[dev].mu);
    learn_locked(dev);
    uint64_t g = takes[dev].page, a = takes[dev].unit;
    CUresult rc;
    *unit = 0;
    if (g == 0) { /* the driver told us nothing: the smallest unit CUDA documents (cudaMalloc's 256 B alignment) */
        *charged = round_to(size, 256);
        rc = vgpu_mem_reserve(dev, *charged);
    } else if (g > a && size < g / 2) {
        uint64_t u = round_to(size, a), live = takes[dev].small_live;
        *charged = (pages_of(live + u, g) - pages_of(live, g)) * g;
        rc = *charged ? vgpu_mem_reserve(dev, *charged) : CUDA_SUCCESS;
        if (rc == CUDA_SUCCESS) {
            takes[dev].small_live = live + u;
            *unit = u;
        }
    } else {
        *charged = round_to(size, g);
        rc = vgpu_mem_reserve(dev, *charged);
    }
    pthread_mutex_unlock(&takes[dev].mu);
    return rc;
}

/* Give back what take() reserved: `bytes` for an allocation with pages of its own, or the pages
 * its sub-allocated `unit` no longer fills. */
static void give_back(int dev, uint64_t bytes, uint64_t unit) {
    if (unit == 0) {
        vgpu_mem_release(dev, bytes);
        return;
    }
    pthread_once(&takes_once, takes_init);
    pthread_mutex_lock(&takes[dev].mu);
    uint64_t g = takes[dev].page, live = takes[dev].small_live;
    uint64_t after = live > unit ? live - unit : 0;
    takes[dev].small_live = after;
    uint64_t back = g ? (pages_of(live, g) - pages_of(after, g)) * g : 0;
    pthread_mutex_unlock(&takes[dev].mu);
    if (back) vgpu_mem_release(dev, back);
}

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

/* Record a successful allocation (its charge, or its sub-allocated unit in aux); if even that
 * fails (out of host memory), undo it all. */
static CUresult record(int kind, uint64_t key, int dev, uint64_t bytes, uint64_t unit, CUresult (*undo)(uint64_t)) {
    if (vgpu_track_add_aux(kind, key, dev, bytes, unit) == 0) return CUDA_SUCCESS;
    undo(key);
    give_back(dev, bytes, unit);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* cuMemAlloc-like: take, allocate, record (or give back). */
#define ALLOC_TAKEN(dev, size, call, undo)                                                       \
    do {                                                                                         \
        uint64_t charged_, unit_;                                                                \
        if ((st = take(dev, size, &charged_, &unit_)) != CUDA_SUCCESS) return st;                \
        CUresult rc_ = (call);                                                                   \
        if (rc_ != CUDA_SUCCESS) {                                                               \
            give_back(dev, charged_, unit_);                                                     \
            return rc_;                                                                          \
        }                                                                                        \
        return record(VGPU_TRACK_PTR, *dptr, dev, charged_, unit_, undo);                        \
    } while (0)

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
    ALLOC_TAKEN(dev, bytesize, real_cuMemAlloc_v2(dptr, bytesize), undo_free_v2);
}

CUresult hook_cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemAlloc == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    if (!vgpu_mem_active() || dptr == NULL || bytesize == 0 || (dev = vgpu_current_device_index()) < 0)
        return real_cuMemAlloc(dptr, bytesize);
    ALLOC_TAKEN(dev, bytesize, real_cuMemAlloc(dptr, bytesize), undo_free_v1);
}

CUresult hook_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemAllocManaged == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    /* Managed memory can live on the device: it is charged to the current context's device. */
    if (!vgpu_mem_active() || dptr == NULL || bytesize == 0 || (dev = vgpu_current_device_index()) < 0)
        return real_cuMemAllocManaged(dptr, bytesize, flags);
    ALLOC_TAKEN(dev, bytesize, real_cuMemAllocManaged(dptr, bytesize, flags), undo_free_v2);
}

/* ---- cuMemAllocPitch: take for an upper bound of the pitch; if the driver chose a wider one,
 * take for that instead ---- */

static CUresult pitch_taken(int dev, CUdeviceptr p, uint64_t pitch, uint64_t height, uint64_t bound_bytes,
                            uint64_t *charged, uint64_t *unit, CUresult (*undo)(uint64_t)) {
    uint64_t actual = mul_sat(pitch, height);
    if (actual <= bound_bytes) return CUDA_SUCCESS;
    give_back(dev, *charged, *unit);
    if (take(dev, actual, charged, unit) == CUDA_SUCCESS) return CUDA_SUCCESS;
    undo(p); /* a pitch beyond our bound, over quota */
    return CUDA_ERROR_OUT_OF_MEMORY;
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
    uint64_t bound = mul_sat(round_to(WidthInBytes, PITCH_ALIGN_BOUND), Height), charged, unit;
    if ((st = take(dev, bound, &charged, &unit)) != CUDA_SUCCESS) return st;
    CUresult rc = real_cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        give_back(dev, charged, unit);
        return rc;
    }
    if ((rc = pitch_taken(dev, *dptr, *pPitch, Height, bound, &charged, &unit, undo_free_v2)) != CUDA_SUCCESS) return rc;
    return record(VGPU_TRACK_PTR, *dptr, dev, charged, unit, undo_free_v2);
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
    uint64_t bound = mul_sat(round_to(WidthInBytes, PITCH_ALIGN_BOUND), Height), charged, unit;
    if ((st = take(dev, bound, &charged, &unit)) != CUDA_SUCCESS) return st;
    CUresult rc = real_cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        give_back(dev, charged, unit);
        return rc;
    }
    if ((rc = pitch_taken(dev, *dptr, *pPitch, Height, bound, &charged, &unit, undo_free_v1)) != CUDA_SUCCESS) return rc;
    return record(VGPU_TRACK_PTR, *dptr, dev, charged, unit, undo_free_v1);
}

/* ---- cuMemFree: take the record first (so a concurrent allocation reusing the address cannot
 * be confused with this one), free, and put it back if the driver refused ---- */

CUresult hook_cuMemFree_v2(CUdeviceptr dptr) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemFree_v2 == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    uint64_t bytes, unit;
    if (!vgpu_mem_active()) return real_cuMemFree_v2(dptr);
    /* cuMemFree also frees stream-ordered allocations (after synchronising) */
    if (!vgpu_track_take_aux(VGPU_TRACK_PTR, dptr, &dev, &bytes, &unit)) return vgpu_pools_free_sync(dptr, real_cuMemFree_v2);
    CUresult rc = real_cuMemFree_v2(dptr);
    if (rc == CUDA_SUCCESS) give_back(dev, bytes, unit);
    else vgpu_track_add_aux(VGPU_TRACK_PTR, dptr, dev, bytes, unit);
    return rc;
}

CUresult hook_cuMemFree(CUdeviceptr_v1 dptr) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMemFree == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    uint64_t bytes, unit;
    if (!vgpu_mem_active() || !vgpu_track_take_aux(VGPU_TRACK_PTR, dptr, &dev, &bytes, &unit)) return real_cuMemFree(dptr);
    CUresult rc = real_cuMemFree(dptr);
    if (rc == CUDA_SUCCESS) give_back(dev, bytes, unit);
    else vgpu_track_add_aux(VGPU_TRACK_PTR, dptr, dev, bytes, unit);
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

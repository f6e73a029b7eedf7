/*
 * CUDA arrays: their size is not an argument, so it is computed from the descriptor, charged
 * before the array is created and returned at cuArrayDestroy / cuMipmappedArrayDestroy.
 * The driver's layout of an array is opaque; the formula is the simulator's documented one
 * (shim/sim/cuda/arrays.c), a faithful model of what the hardware takes:
 *   row pitch = align_up(width * channels * element size, 512)
 *   bytes     = pitch * max(height, 1) * max(depth, 1)   (layers and cube faces are depth)
 *   charged   = align_up(bytes, 2 MiB)                   (arrays live in whole large pages)
 * A mipmapped array sums its levels (each halves every extent but layers, down to 1) and is
 * rounded up once.
 */
#include "shim_internal.h"

#define ARRAY_PITCH_ALIGN 512ULL
#define ARRAY_GRANULE (2ULL << 20)

static uint64_t mul_sat(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

/* bytes per channel, 0 for a format we do not know (the driver then decides) */
static uint64_t format_bytes(CUarray_format f) {
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    }
    return 0;
}

static uint64_t nz(uint64_t v) { return v ? v : 1; }

static uint64_t round_up_sat(uint64_t v, uint64_t a) { return v > UINT64_MAX - (a - 1) ? UINT64_MAX : (v + a - 1) / a * a; }

/* One level's bytes; 0 = not computable (unknown format, zero width): pass through uncharged,
 * the driver rejects the descriptor itself. */
static uint64_t level_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format fmt, unsigned channels) {
    uint64_t e = format_bytes(fmt);
    if (e == 0 || w == 0 || channels == 0) return 0;
    uint64_t pitch = round_up_sat(mul_sat(w, e * channels), ARRAY_PITCH_ALIGN);
    return mul_sat(mul_sat(pitch, nz(h)), nz(d));
}

static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format fmt, unsigned channels) {
    return round_up_sat(level_bytes(w, h, d, fmt, channels), ARRAY_GRANULE);
}

static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *a, unsigned levels) {
    uint64_t total = 0;
    int layered = (a->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    uint64_t w = a->Width, h = a->Height, d = a->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t lb = level_bytes(w, h, d, a->Format, a->NumChannels);
        if (lb == 0) return 0;
        total = total > UINT64_MAX - lb ? UINT64_MAX : total + lb;
        w = w > 1 ? w / 2 : 1;
        if (h) h = h > 1 ? h / 2 : 1;
        if (d && !layered) d = d > 1 ? d / 2 : 1; /* layers (and cube faces) do not shrink */
    }
    return round_up_sat(total, ARRAY_GRANULE);
}

static CUresult charged_create(int kind, uint64_t bytes, CUresult (*create)(const void *, void *), const void *args,
                               void **handle_out) {
    int dev;
    if (bytes == 0 || (dev = vgpu_current_device_index()) < 0) return create(args, NULL);
    CUresult st = vgpu_mem_reserve(dev, bytes);
    if (st != CUDA_SUCCESS) return st;
    CUresult rc = create(args, NULL);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, bytes);
        return rc;
    }
    if (vgpu_track_add(kind, (uint64_t)(uintptr_t)*handle_out, dev, bytes) != 0) {
        /* out of host memory: keep the array, uncharged would be unlimited; give it back */
        if (kind == VGPU_TRACK_MIPMAP) real_cuMipmappedArrayDestroy((CUmipmappedArray)*handle_out);
        else real_cuArrayDestroy((CUarray)*handle_out);
        vgpu_mem_release(dev, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

/* small adaptors so one charging path serves the four creators */
struct a2 { CUarray *h; const CUDA_ARRAY_DESCRIPTOR *d; };
struct a1 { CUarray *h; const CUDA_ARRAY_DESCRIPTOR_v1 *d; };
struct a3 { CUarray *h; const CUDA_ARRAY3D_DESCRIPTOR *d; };
struct a31 { CUarray *h; const CUDA_ARRAY3D_DESCRIPTOR_v1 *d; };
struct mm { CUmipmappedArray *h; const CUDA_ARRAY3D_DESCRIPTOR *d; unsigned n; };
static CUresult c_a2(const void *p, void *u) { (void)u; const struct a2 *a = p; return real_cuArrayCreate_v2(a->h, a->d); }
static CUresult c_a1(const void *p, void *u) { (void)u; const struct a1 *a = p; return real_cuArrayCreate(a->h, a->d); }
static CUresult c_a3(const void *p, void *u) { (void)u; const struct a3 *a = p; return real_cuArray3DCreate_v2(a->h, a->d); }
static CUresult c_a31(const void *p, void *u) { (void)u; const struct a31 *a = p; return real_cuArray3DCreate(a->h, a->d); }
static CUresult c_mm(const void *p, void *u) { (void)u; const struct mm *a = p; return real_cuMipmappedArrayCreate(a->h, a->d, a->n); }

#define PRELUDE(real, ...)                                                                         \
    CUresult st = vgpu_init();                                                                     \
    if (st != CUDA_SUCCESS) return st;                                                             \
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;                                             \
    if (!vgpu_mem_active() || pHandle == NULL || desc == NULL) return real(__VA_ARGS__);

CUresult hook_cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc) {
    PRELUDE(real_cuArrayCreate_v2, pHandle, desc)
    struct a2 a = {pHandle, desc};
    return charged_create(VGPU_TRACK_ARRAY, array_bytes(desc->Width, desc->Height, 0, desc->Format, desc->NumChannels),
                          c_a2, &a, (void **)pHandle);
}

CUresult hook_cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *desc) {
    PRELUDE(real_cuArrayCreate, pHandle, desc)
    struct a1 a = {pHandle, desc};
    return charged_create(VGPU_TRACK_ARRAY, array_bytes(desc->Width, desc->Height, 0, desc->Format, desc->NumChannels),
                          c_a1, &a, (void **)pHandle);
}

CUresult hook_cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    PRELUDE(real_cuArray3DCreate_v2, pHandle, desc)
    struct a3 a = {pHandle, desc};
    return charged_create(VGPU_TRACK_ARRAY,
                          array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels), c_a3, &a,
                          (void **)pHandle);
}

CUresult hook_cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *desc) {
    PRELUDE(real_cuArray3DCreate, pHandle, desc)
    struct a31 a = {pHandle, desc};
    return charged_create(VGPU_TRACK_ARRAY,
                          array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels), c_a31,
                          &a, (void **)pHandle);
}

CUresult hook_cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                     unsigned int numMipmapLevels) {
    PRELUDE(real_cuMipmappedArrayCreate, pHandle, desc, numMipmapLevels)
    struct mm a = {pHandle, desc, numMipmapLevels};
    return charged_create(VGPU_TRACK_MIPMAP, mipmap_bytes(desc, numMipmapLevels), c_mm, &a, (void **)pHandle);
}

CUresult hook_cuArrayDestroy(CUarray hArray) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuArrayDestroy == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    uint64_t bytes, key = (uint64_t)(uintptr_t)hArray;
    if (!vgpu_mem_active() || !vgpu_track_take(VGPU_TRACK_ARRAY, key, &dev, &bytes)) return real_cuArrayDestroy(hArray);
    CUresult rc = real_cuArrayDestroy(hArray);
    if (rc == CUDA_SUCCESS) vgpu_mem_release(dev, bytes);
    else vgpu_track_add(VGPU_TRACK_ARRAY, key, dev, bytes);
    return rc;
}

CUresult hook_cuMipmappedArrayDestroy(CUmipmappedArray h) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuMipmappedArrayDestroy == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int dev;
    uint64_t bytes, key = (uint64_t)(uintptr_t)h;
    if (!vgpu_mem_active() || !vgpu_track_take(VGPU_TRACK_MIPMAP, key, &dev, &bytes)) return real_cuMipmappedArrayDestroy(h);
    CUresult rc = real_cuMipmappedArrayDestroy(h);
    if (rc == CUDA_SUCCESS) vgpu_mem_release(dev, bytes);
    else vgpu_track_add(VGPU_TRACK_MIPMAP, key, dev, bytes);
    return rc;
}

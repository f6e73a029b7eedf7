/*
 * CUDA arrays: their size is not an argument and their layout (tiling, padding) is the driver's,
 * so the driver is asked what one takes, before it is created: a twin of the array with
 * CUDA_ARRAY3D_DEFERRED_MAPPING (CUDA 11.6: created without memory) reports its size
 * (cuArrayGetMemoryRequirements / cuMipmappedArrayGetMemoryRequirements) and is destroyed. The
 * array is charged that size rounded up to its reported alignment and to the device's page (as
 * learned from the driver, memory.c), returned at cuArrayDestroy / cuMipmappedArrayDestroy.
 *
 * A driver that cannot answer (older than 11.6, a device or descriptor without deferred
 * mapping): an estimate from what the driver reports about the device: rows of width * element
 * bytes aligned to CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT (else the allocation alignment),
 * times height and depth (layers and cube faces are depth), levels of a mipmapped array summed
 * (each halves every extent but layers), rounded up to the page. A tiled layout may take more
 * than this estimate: that case is logged once per process.
 */
#include <stdatomic.h>

#include "devices.h"
#include "hooks.h"
#include "init.h"
#include "log.h"
#include "reserve.h"
#include "symbols.h"
#include "track.h"

typedef CUresult (*req_array_fn)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, CUarray, CUdevice);
typedef CUresult (*req_mipmap_fn)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, CUmipmappedArray, CUdevice);
typedef CUresult (*attr_fn)(int *, CUdevice_attribute, CUdevice);

static uint64_t mul_sat(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

static uint64_t round_up_sat(uint64_t v, uint64_t a) {
    if (a <= 1) return v;
    return v > UINT64_MAX - (a - 1) ? UINT64_MAX : (v + a - 1) / a * a;
}

/* ---- asking the driver ---- */

/* Bytes the driver reports an array (levels == 0) or mipmapped array of descriptor d needs on
 * device cud, rounded to its alignment; 0 when it cannot say. */
static uint64_t required_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels, CUdevice cud) {
    static req_array_fn req_array;
    static req_mipmap_fn req_mipmap;
    if (req_array == NULL) req_array = (req_array_fn)vgpu_cuda_sym("cuArrayGetMemoryRequirements");
    if (req_mipmap == NULL) req_mipmap = (req_mipmap_fn)vgpu_cuda_sym("cuMipmappedArrayGetMemoryRequirements");
    CUDA_ARRAY3D_DESCRIPTOR twin = *d;
    twin.Flags |= CUDA_ARRAY3D_DEFERRED_MAPPING;
    CUDA_ARRAY_MEMORY_REQUIREMENTS req = {0};
    CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
    if (levels == 0) {
        CUarray a;
        if (req_array == NULL || real_cuArray3DCreate_v2 == NULL || real_cuArrayDestroy == NULL ||
            real_cuArray3DCreate_v2(&a, &twin) != CUDA_SUCCESS)
            return 0;
        rc = req_array(&req, a, cud);
        real_cuArrayDestroy(a);
    } else {
        CUmipmappedArray m;
        if (req_mipmap == NULL || real_cuMipmappedArrayCreate == NULL || real_cuMipmappedArrayDestroy == NULL ||
            real_cuMipmappedArrayCreate(&m, &twin, levels) != CUDA_SUCCESS)
            return 0;
        rc = req_mipmap(&req, m, cud);
        real_cuMipmappedArrayDestroy(m);
    }
    return rc == CUDA_SUCCESS ? round_up_sat(req.size, req.alignment) : 0;
}

/* ---- the estimate, where the driver cannot say ---- */

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

/* The row alignment the driver reports for the device (0: none). */
static uint64_t pitch_alignment(CUdevice cud) {
    static attr_fn attr;
    if (attr == NULL) attr = (attr_fn)vgpu_cuda_sym("cuDeviceGetAttribute");
    int v = 0;
    if (attr != NULL && attr(&v, CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT, cud) == CUDA_SUCCESS && v > 0)
        return (uint64_t)v;
    if (attr != NULL && attr(&v, CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, cud) == CUDA_SUCCESS && v > 0)
        return (uint64_t)v;
    return 0;
}

/* One level's bytes; 0 = not computable (unknown format, zero width). */
static uint64_t level_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format fmt, unsigned channels, uint64_t align) {
    uint64_t e = format_bytes(fmt);
    if (e == 0 || w == 0 || channels == 0) return 0;
    uint64_t pitch = round_up_sat(mul_sat(w, e * channels), align);
    return mul_sat(mul_sat(pitch, nz(h)), nz(d));
}

static uint64_t estimated_bytes(const CUDA_ARRAY3D_DESCRIPTOR *a, unsigned levels, CUdevice cud) {
    uint64_t total = 0, align = pitch_alignment(cud);
    int layered = (a->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    uint64_t w = a->Width, h = a->Height, d = a->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t lb = level_bytes(w, h, d, a->Format, a->NumChannels, align);
        if (lb == 0) return 0;
        total = total > UINT64_MAX - lb ? UINT64_MAX : total + lb;
        w = w > 1 ? w / 2 : 1;
        if (h) h = h > 1 ? h / 2 : 1;
        if (d && !layered) d = d > 1 ? d / 2 : 1; /* layers (and cube faces) do not shrink */
    }
    static atomic_flag said = ATOMIC_FLAG_INIT;
    if (!atomic_flag_test_and_set(&said))
        vgpu_log(VGPU_LOG_INFO, "the driver does not report CUDA array sizes (cuArrayGetMemoryRequirements): "
                                "arrays are charged an estimate from their dimensions");
    return total;
}

/* What creating this array takes on the current context's device (index dev), in whole pages;
 * 0 = not computable: pass through uncharged, the driver rejects the descriptor itself. */
static uint64_t array_bytes(int dev, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
    CUdevice cud;
    if (vgpu_device_handle(dev, &cud) != 0) return 0;
    uint64_t b = required_bytes(d, levels, cud);
    if (b == 0) b = estimated_bytes(d, levels, cud);
    return b == 0 ? 0 : round_up_sat(b, vgpu_mem_page(dev));
}

static CUresult charged_create(int kind, const CUDA_ARRAY3D_DESCRIPTOR *d3, unsigned levels,
                               CUresult (*create)(const void *), const void *args, void **handle_out) {
    int dev = vgpu_current_device_index();
    CUresult st;
    if (dev == VGPU_DEVICE_UNACCOUNTED) return (st = vgpu_mem_unaccounted()) != CUDA_SUCCESS ? st : create(args);
    uint64_t bytes;
    if (dev < 0 || (bytes = array_bytes(dev, d3, levels)) == 0) return create(args);
    if ((st = vgpu_mem_reserve(dev, bytes)) != CUDA_SUCCESS) return st;
    CUresult rc = create(args);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, bytes);
        return rc;
    }
    if (vgpu_track_add(kind, (uint64_t)(uintptr_t)*handle_out, dev, bytes) != 0) {
        /* out of host memory: keep the array, uncharged would be unlimited; give it back */
        if (kind == VGPU_TRACK_MIPMAP)
            real_cuMipmappedArrayDestroy((CUmipmappedArray)*handle_out);
        else
            real_cuArrayDestroy((CUarray)*handle_out);
        vgpu_mem_release(dev, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

/* small adaptors so one charging path serves the five creators */
struct a2 {
    CUarray *h;
    const CUDA_ARRAY_DESCRIPTOR *d;
};
struct a1 {
    CUarray *h;
    const CUDA_ARRAY_DESCRIPTOR_v1 *d;
};
struct a3 {
    CUarray *h;
    const CUDA_ARRAY3D_DESCRIPTOR *d;
};
struct a31 {
    CUarray *h;
    const CUDA_ARRAY3D_DESCRIPTOR_v1 *d;
};
struct mm {
    CUmipmappedArray *h;
    const CUDA_ARRAY3D_DESCRIPTOR *d;
    unsigned n;
};
static CUresult c_a2(const void *p) {
    const struct a2 *a = p;
    return real_cuArrayCreate_v2(a->h, a->d);
}
static CUresult c_a1(const void *p) {
    const struct a1 *a = p;
    return real_cuArrayCreate(a->h, a->d);
}
static CUresult c_a3(const void *p) {
    const struct a3 *a = p;
    return real_cuArray3DCreate_v2(a->h, a->d);
}
static CUresult c_a31(const void *p) {
    const struct a31 *a = p;
    return real_cuArray3DCreate(a->h, a->d);
}
static CUresult c_mm(const void *p) {
    const struct mm *a = p;
    return real_cuMipmappedArrayCreate(a->h, a->d, a->n);
}

#define PRELUDE(real, ...)                                                                                             \
    VGPU_HOOK_OPEN(real);                                                                                              \
    if (!vgpu_mem_active() || pHandle == NULL || desc == NULL) return real(__VA_ARGS__);

CUresult hook_cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc) {
    PRELUDE(real_cuArrayCreate_v2, pHandle, desc)
    struct a2 a = {pHandle, desc};
    CUDA_ARRAY3D_DESCRIPTOR d3 = {desc->Width, desc->Height, 0, desc->Format, desc->NumChannels, 0};
    return charged_create(VGPU_TRACK_ARRAY, &d3, 0, c_a2, &a, (void **)pHandle);
}

CUresult hook_cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *desc) {
    PRELUDE(real_cuArrayCreate, pHandle, desc)
    struct a1 a = {pHandle, desc};
    CUDA_ARRAY3D_DESCRIPTOR d3 = {desc->Width, desc->Height, 0, desc->Format, desc->NumChannels, 0};
    return charged_create(VGPU_TRACK_ARRAY, &d3, 0, c_a1, &a, (void **)pHandle);
}

CUresult hook_cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    PRELUDE(real_cuArray3DCreate_v2, pHandle, desc)
    struct a3 a = {pHandle, desc};
    return charged_create(VGPU_TRACK_ARRAY, desc, 0, c_a3, &a, (void **)pHandle);
}

CUresult hook_cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *desc) {
    PRELUDE(real_cuArray3DCreate, pHandle, desc)
    struct a31 a = {pHandle, desc};
    CUDA_ARRAY3D_DESCRIPTOR d3 = {desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels, desc->Flags};
    return charged_create(VGPU_TRACK_ARRAY, &d3, 0, c_a31, &a, (void **)pHandle);
}

CUresult hook_cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                     unsigned int numMipmapLevels) {
    PRELUDE(real_cuMipmappedArrayCreate, pHandle, desc, numMipmapLevels)
    struct mm a = {pHandle, desc, numMipmapLevels};
    if (numMipmapLevels == 0) return c_mm(&a); /* the driver's error */
    return charged_create(VGPU_TRACK_MIPMAP, desc, numMipmapLevels, c_mm, &a, (void **)pHandle);
}
CUresult hook_cuArrayDestroy(CUarray hArray) {
    VGPU_HOOK_OPEN(real_cuArrayDestroy);
    int dev;
    uint64_t bytes, key = (uint64_t)(uintptr_t)hArray;
    if (!vgpu_mem_active() || !vgpu_track_take(VGPU_TRACK_ARRAY, key, &dev, &bytes)) return real_cuArrayDestroy(hArray);
    CUresult rc = real_cuArrayDestroy(hArray);
    if (rc == CUDA_SUCCESS)
        vgpu_mem_release(dev, bytes);
    else
        vgpu_track_add(VGPU_TRACK_ARRAY, key, dev, bytes);
    return rc;
}

CUresult hook_cuMipmappedArrayDestroy(CUmipmappedArray h) {
    VGPU_HOOK_OPEN(real_cuMipmappedArrayDestroy);
    int dev;
    uint64_t bytes, key = (uint64_t)(uintptr_t)h;
    if (!vgpu_mem_active() || !vgpu_track_take(VGPU_TRACK_MIPMAP, key, &dev, &bytes))
        return real_cuMipmappedArrayDestroy(h);
    CUresult rc = real_cuMipmappedArrayDestroy(h);
    if (rc == CUDA_SUCCESS)
        vgpu_mem_release(dev, bytes);
    else
        vgpu_track_add(VGPU_TRACK_MIPMAP, key, dev, bytes);
    return rc;
}

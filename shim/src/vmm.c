/*
 * Virtual memory management: physical memory is taken by cuMemCreate (device-located handles)
 * and freed by the driver when the handle is released AND its last mapping is unmapped
 * (cuMemRelease: "the memory will be freed when all outstanding mappings to the memory are
 * unmapped"). So the charge lives as long: a program that creates, maps and releases without
 * unmapping keeps the memory on the device, and must keep it on the slice's quota. A handle takes
 * its size in whole units of the granularity the driver reports for its properties
 * (cuMemGetAllocationGranularity, minimum; the driver refuses other sizes, so this is the size
 * itself whenever the driver accepts it).
 * Each charged handle's record (track.c) keeps in its aux word the driver's references
 * (cuMemCreate 1, + each cuMemRetainAllocationHandle, - each cuMemRelease; 0: released) and its
 * mappings (cuMemMap + 1, - each that cuMemUnmap or cuMemAddressFree takes away); the mappings
 * themselves are in track.c's ordered table, since an unmap names an address range, not a handle.
 * The charge returns when both counts are 0.
 *
 * Shareable handles: an allocation exported (cuMemExportToShareableHandle) and imported in another
 * process lives on the device while any process holds a handle to it or maps it. The exporter's
 * rules are the ones above; the shim cannot see other processes' handles, so a handle this process
 * imported is charged here once it maps it: its record is kept from the import (flag IMPORTED, no
 * bytes), and each cuMemMap of it first charges what the mapping reaches beyond what is charged
 * (offset + size, in whole granules: the driver reveals no imported handle's size, but a mapping
 * proves the allocation that large), refused with CUDA_ERROR_OUT_OF_MEMORY on the quota before the
 * driver maps anything. The charge then returns as a created handle's does (released and
 * unmapped). While the exporter holds it too, both slices pay for it: too much, never too little.
 */
#include <pthread.h>

#include "devices.h"
#include "hooks.h"
#include "init.h"
#include "log.h"
#include "reserve.h"
#include "symbols.h"
#include "track.h"

/* A charged handle's counts and the driver's change together: every hook below that touches them
 * calls the driver under this lock, so that a release racing an unmap, or a map at an address an
 * unmap is just giving back, never sees the driver and the record disagree. */
static pthread_mutex_t handles_mu = PTHREAD_MUTEX_INITIALIZER;

static pthread_once_t handles_once = PTHREAD_ONCE_INIT;

/* A fork child gets the lock as it was: another thread of the parent may have held it (the
 * handles' records themselves are reset with track.c's). */
static void atfork_child(void) { pthread_mutex_init(&handles_mu, NULL); }
static void handles_init(void) { pthread_atfork(NULL, NULL, atfork_child); }

static void lock_handles(void) {
    pthread_once(&handles_once, handles_init);
    pthread_mutex_lock(&handles_mu);
}

/* aux word of a handle's record: references in the low half, mappings in the high half but its
 * top bit, set for a handle imported (its charge comes with its mappings) */
#define IMPORTED        (1ull << 63)
#define REFS(aux)       ((aux) & 0xffffffffu)
#define MAPS(aux)       (((aux) >> 32) & COUNT_MAX)
#define AUX(refs, maps) (((uint64_t)(maps) << 32) | (uint64_t)(refs))
#define COUNT_MAX       0x7fffffffu

/* Apply a change to a charged handle's counts (handles_mu held; a handle not charged here is left
 * alone): d_refs, d_maps are +1, 0 or -1, never taking a count below 0 or past COUNT_MAX (a driver
 * that answers success where ours says the handle is released is not followed into a double
 * uncharge). The charge returns when both are 0. */
static void handle_count(CUmemGenericAllocationHandle handle, int d_refs, int d_maps) {
    int dev;
    uint64_t bytes, aux;
    if (!vgpu_track_peek_aux(VGPU_TRACK_HANDLE, handle, &dev, &bytes, &aux)) return; /* not ours */
    uint64_t refs = REFS(aux), maps = MAPS(aux);
    if (d_refs > 0 && refs < COUNT_MAX) refs++;
    if (d_refs < 0 && refs > 0) refs--;
    if (d_maps > 0 && maps < COUNT_MAX) maps++;
    if (d_maps < 0 && maps > 0) maps--;
    if (refs == 0 && maps == 0) {
        /* released and unmapped: the driver freed it */
        if (vgpu_track_take(VGPU_TRACK_HANDLE, handle, NULL, NULL) && bytes > 0) vgpu_mem_release(dev, bytes);
    } else {
        vgpu_track_set_aux(VGPU_TRACK_HANDLE, handle, AUX(refs, maps) | (aux & IMPORTED));
    }
}

/* Is `handle` one this process charged? (handles_mu held) */
static int handle_charged(CUmemGenericAllocationHandle handle) {
    return vgpu_track_peek_aux(VGPU_TRACK_HANDLE, handle, NULL, NULL, NULL);
}

/* The driver says nothing is mapped in [ptr, ptr + size) any more: every recorded mapping there
 * (`whole`: wholly inside the range; else any that meets it) is gone. (handles_mu held) */
static void mappings_gone(CUdeviceptr ptr, size_t size, int whole) {
    uint64_t handle;
    while (vgpu_track_map_take(ptr, size, whole, &handle)) handle_count(handle, 0, -1);
}

typedef CUresult (*gran_fn)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
typedef CUresult (*props_fn)(CUmemAllocationProp *, CUmemGenericAllocationHandle);

/* The properties of a handle, as the driver reports them: 0, or -1. */
static int handle_props(CUmemGenericAllocationHandle handle, CUmemAllocationProp *prop) {
    static props_fn props;
    if (props == NULL) props = (props_fn)vgpu_cuda_sym("cuMemGetAllocationPropertiesFromHandle");
    *prop = (CUmemAllocationProp){0};
    return props != NULL && props(prop, handle) == CUDA_SUCCESS ? 0 : -1;
}

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
    if (vgpu_track_add_aux(VGPU_TRACK_HANDLE, *handle, dev, charge, AUX(1, 0)) != 0) {
        real_cuMemRelease(*handle);
        vgpu_mem_release(dev, charge);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

CUresult hook_cuMemRelease(CUmemGenericAllocationHandle handle) {
    VGPU_HOOK_OPEN(real_cuMemRelease);
    if (!vgpu_mem_active()) return real_cuMemRelease(handle);
    lock_handles();
    CUresult rc = real_cuMemRelease(handle);
    if (rc == CUDA_SUCCESS) handle_count(handle, -1, 0); /* still mapped: the charge stays */
    pthread_mutex_unlock(&handles_mu);
    return rc;
}

CUresult hook_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    VGPU_HOOK_OPEN(real_cuMemRetainAllocationHandle);
    if (!vgpu_mem_active() || handle == NULL) return real_cuMemRetainAllocationHandle(handle, addr);
    lock_handles();
    CUresult rc = real_cuMemRetainAllocationHandle(handle, addr);
    /* a reference more, even to a handle released while mapped: its next release drops it again */
    if (rc == CUDA_SUCCESS) handle_count(*handle, +1, 0);
    pthread_mutex_unlock(&handles_mu);
    return rc;
}

CUresult hook_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                             CUmemAllocationHandleType shHandleType) {
    VGPU_HOOK_OPEN(real_cuMemImportFromShareableHandle);
    if (!vgpu_mem_active() || handle == NULL)
        return real_cuMemImportFromShareableHandle(handle, osHandle, shHandleType);
    lock_handles();
    CUresult rc = real_cuMemImportFromShareableHandle(handle, osHandle, shHandleType);
    CUmemAllocationProp prop;
    int dev = -1;
    if (rc != CUDA_SUCCESS) goto done;
    /* a handle imported twice is one handle to the driver: one reference more */
    if (handle_charged(*handle)) {
        handle_count(*handle, +1, 0);
        goto done;
    }
    if (handle_props(*handle, &prop) == 0 && prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        dev = vgpu_device_index(prop.location.id);
    if (dev == -1) goto done; /* not device memory the shim accounts (as cuMemCreate) */
    /* a device beyond those accounted: its mappings could not be charged, so the import is refused
     * when a limit is set (as cuMemCreate on it) */
    if (dev == VGPU_DEVICE_UNACCOUNTED) rc = vgpu_mem_unaccounted();
    /* untracked, its mappings would hold memory uncharged: refused */
    else if (vgpu_track_add_aux(VGPU_TRACK_HANDLE, *handle, dev, 0, AUX(1, 0) | IMPORTED) != 0)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (rc != CUDA_SUCCESS) real_cuMemRelease(*handle);
done:
    pthread_mutex_unlock(&handles_mu);
    return rc;
}

/* Before cuMemMap of an imported handle: charge what [offset, offset + size) reaches beyond its
 * charge so far (*grown: the bytes added, to give back if the driver refuses the map). (handles_mu
 * held) */
static CUresult charge_import_map(CUmemGenericAllocationHandle handle, size_t size, size_t offset, uint64_t *grown) {
    int dev;
    uint64_t bytes, aux, reach;
    CUmemAllocationProp prop;
    CUresult st = CUDA_SUCCESS;
    *grown = 0;
    /* not imported, or no such mapping (the driver refuses it): nothing to charge */
    if (!vgpu_track_peek_aux(VGPU_TRACK_HANDLE, handle, &dev, &bytes, &aux) || !(aux & IMPORTED) ||
        size > UINT64_MAX - offset)
        goto out;
    reach = handle_props(handle, &prop) == 0 ? handle_bytes((uint64_t)offset + size, &prop) : offset + size;
    if (reach <= bytes || (st = vgpu_mem_reserve(dev, reach - bytes)) != CUDA_SUCCESS) goto out;
    if (vgpu_track_move_bytes(VGPU_TRACK_HANDLE, handle, bytes, reach)) {
        *grown = reach - bytes;
    } else {
        vgpu_mem_release(dev, reach - bytes); /* cannot happen under handles_mu; never charged twice */
        st = CUDA_ERROR_OUT_OF_MEMORY;
    }
out:
    return st;
}

CUresult hook_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                       unsigned long long flags) {
    VGPU_HOOK_OPEN(real_cuMemMap);
    if (!vgpu_mem_active()) return real_cuMemMap(ptr, size, offset, handle, flags);
    lock_handles();
    uint64_t grown = 0;
    CUresult rc = charge_import_map(handle, size, offset, &grown);
    if (rc != CUDA_SUCCESS) goto done; /* fail closed: nothing mapped */
    rc = real_cuMemMap(ptr, size, offset, handle, flags);
    if (rc != CUDA_SUCCESS && grown > 0) {
        int dev;
        uint64_t bytes;
        if (vgpu_track_peek_aux(VGPU_TRACK_HANDLE, handle, &dev, &bytes, NULL) &&
            vgpu_track_move_bytes(VGPU_TRACK_HANDLE, handle, bytes, bytes - grown))
            vgpu_mem_release(dev, grown);
    }
    /* the driver mapped the range, so whatever was recorded there went by a route not seen */
    if (rc == CUDA_SUCCESS) mappings_gone(ptr, size, 0);
    if (rc == CUDA_SUCCESS && handle_charged(handle)) {
        if (vgpu_track_map_add(ptr, size, handle) == 0) {
            handle_count(handle, 0, +1);
        } else {
            /* untracked, the mapping would let the charge go while the memory lives: undone */
            CUresult undo = real_cuMemUnmap ? real_cuMemUnmap(ptr, size) : CUDA_ERROR_NOT_SUPPORTED;
            if (undo != CUDA_SUCCESS)
                vgpu_log(VGPU_LOG_WARN, "cuMemMap: no room to record a mapping and its unmap failed (%d)", (int)undo);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
done:
    pthread_mutex_unlock(&handles_mu);
    return rc;
}

CUresult hook_cuMemUnmap(CUdeviceptr ptr, size_t size) {
    VGPU_HOOK_OPEN(real_cuMemUnmap);
    if (!vgpu_mem_active()) return real_cuMemUnmap(ptr, size);
    lock_handles();
    CUresult rc = real_cuMemUnmap(ptr, size);
    /* NVIDIA's driver unmaps whole mappings only; a mapping the range covers in part (a driver that
     * allowed it) keeps its record and its handle's charge: too much, never too little */
    if (rc == CUDA_SUCCESS) mappings_gone(ptr, size, 1);
    pthread_mutex_unlock(&handles_mu);
    return rc;
}

CUresult hook_cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    VGPU_HOOK_OPEN(real_cuMemAddressFree);
    if (!vgpu_mem_active()) return real_cuMemAddressFree(ptr, size);
    lock_handles();
    CUresult rc = real_cuMemAddressFree(ptr, size);
    /* the reservation is gone, and with it any mapping still in it (a driver that refuses to free a
     * mapped range answers an error, and nothing changes) */
    if (rc == CUDA_SUCCESS) mappings_gone(ptr, size, 0);
    pthread_mutex_unlock(&handles_mu);
    return rc;
}

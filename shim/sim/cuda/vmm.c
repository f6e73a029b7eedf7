/*
 * Virtual memory management: physical allocations (cuMemCreate) mapped into reserved address
 * ranges (cuMemAddressReserve + cuMemMap + cuMemSetAccess).
 *
 *  - A physical allocation is a memfd of its size (sparse: pages are committed when written), so
 *    two mappings of one handle share data, as on a GPU. Sizes and addresses must be multiples of
 *    the granularity, 2 MiB (cuMemGetAllocationGranularity reports it for both options).
 *  - It is charged to the device at cuMemCreate and freed (uncharged, its memfd closed) only when
 *    it is both released and unmapped, as NVIDIA's driver frees it: cuMemRelease "will free the
 *    memory when all outstanding mappings to the memory are unmapped". A handle released while
 *    mapped stays charged (cuMemGetInfo, NVML) until its last mapping goes; it is then no longer a
 *    handle the program may use (map, release, export: CUDA_ERROR_INVALID_VALUE), except through
 *    cuMemRetainAllocationHandle of a mapped address, which gives it a reference again.
 *  - A reservation is a PROT_NONE mapping; cuMemMap maps the memfd over part of it (still no
 *    access); cuMemSetAccess makes it readable/writable; cuMemUnmap puts PROT_NONE back. An unmap
 *    takes whole mappings (one or several): a range that covers part of a mapping is
 *    CUDA_ERROR_INVALID_VALUE, as the driver's "cannot unmap a sub-range"; cuMemAddressFree
 *    unmaps whatever is still mapped in the reservation.
 *    Copies into a mapped range without access are CUDA_ERROR_INVALID_VALUE, not a fault.
 *  - A handle is counted: cuMemRetainAllocationHandle (the handle of a mapped address) adds a
 *    reference, each cuMemRelease drops one; the memory is returned at the last.
 *  - Shareable handles (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, if requested at cuMemCreate):
 *    the export is a descriptor of the memfd, named for the physical device; an import (in this
 *    or another process, the descriptor passed over a unix socket) is a new handle of the same
 *    pages. Other handle types: CUDA_ERROR_NOT_SUPPORTED.
 *    The physical allocation is one, however many processes hold it: its memory stays used on the
 *    device while any process holds a handle to it (created or imported) or maps it, and is freed
 *    when the last lets go or dies, as the driver frees it. It is counted once on the device, in
 *    the node state's table of shared allocations (state.h, sim_vmm_share): a process holds it
 *    while any of its handles of it lives (references or mappings); its bytes are in one holder's
 *    slot (NVML's process list): the creator's while it holds it, then another holder's.
 *    A descriptor alone holds nothing: importing one whose allocation every holder let go is
 *    CUDA_ERROR_INVALID_VALUE.
 */
#define _GNU_SOURCE 1 /* memfd_create */
#include "ctxstack.h"
#include "init.h"
#include "memory.h"
#include "vmm.h"

#include "../common/state.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct vmm_handle {
    CUmemGenericAllocationHandle id;
    int fd;
    size_t size;
    int dev;
    uint64_t charged;
    uint64_t key; /* shareable: the memfd's inode, its entry in the node's table; 0: not shareable */
    int refs;     /* cuMemCreate / import 1, + each retain, - each release; 0: released */
    int maps;     /* live cuMemMap mappings of it; freed when refs and maps are both 0 */
    CUmemAllocationProp prop;
    struct vmm_handle *next;
} vmm_handle;

typedef struct vmm_reserve {
    uintptr_t base;
    size_t size;
    struct vmm_reserve *next;
} vmm_reserve;

static vmm_handle *handles;   /* G.lock */
static vmm_reserve *reserves; /* G.lock */
static CUmemGenericAllocationHandle next_id = 0x5100;

/* The handle `id`, released or not (a released one lives on while it is mapped). */
static vmm_handle *find_any(CUmemGenericAllocationHandle id) {
    for (vmm_handle *h = handles; h; h = h->next)
        if (h->id == id) return h;
    return NULL;
}

/* The handle `id` as the program may name it: not released. */
static vmm_handle *find_handle(CUmemGenericAllocationHandle id) {
    vmm_handle *h = find_any(id);
    return h && h->refs > 0 ? h : NULL;
}

/* Does this process hold the shared allocation `key` of device dev (other than through `except`)?
 * G.lock held. */
static int holds_share(int dev, uint64_t key, const vmm_handle *except) {
    for (vmm_handle *h = handles; h; h = h->next)
        if (h != except && h->key == key && h->dev == dev) return 1;
    return 0;
}

/* Free h's memory once nothing holds it: neither a reference nor a mapping. A shareable one is the
 * process's no more once its last handle of it goes; the device frees it with its last holder.
 * G.lock held. */
static void free_if_unused_locked(vmm_handle *h) {
    if (h->refs > 0 || h->maps > 0) return;
    vmm_handle **pp = &handles;
    while (*pp != h) pp = &(*pp)->next;
    *pp = h->next;
    if (h->key == 0)
        sim_mem_uncharge(G.slot, sim_phys(h->dev), h->charged);
    else if (!holds_share(h->dev, h->key, h))
        sim_vmm_share_drop(G.slot, sim_phys(h->dev), h->key);
    close(h->fd);
    free(h);
}

void sim_vmm_after_fork(void) {
    /* the parent's handles hold its allocations, not the child's (a child starts with no CUDA
     * state): its copies of their descriptors are closed, the lists forgotten */
    while (handles) {
        vmm_handle *h = handles;
        handles = h->next;
        close(h->fd);
        free(h);
    }
    while (reserves) {
        vmm_reserve *r = reserves;
        reserves = r->next;
        free(r);
    }
}

static vmm_reserve *find_reserve(uintptr_t p, size_t n) {
    for (vmm_reserve *r = reserves; r; r = r->next)
        if (p >= r->base && n <= r->size && p - r->base <= r->size - n) return r;
    return NULL;
}

static CUresult check_prop(const CUmemAllocationProp *prop) {
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_check_device(prop->location.id) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                  CUmemAllocationGranularity_flags option) {
    if (!granularity) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if ((rc = check_prop(prop)) != CUDA_SUCCESS) return rc;
    if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = SIM_VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags) {
    if (!handle || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if ((rc = check_prop(prop)) != CUDA_SUCCESS) return rc;
    if (size == 0 || size % SIM_VMM_GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
    if (size > G.cfg->dev[prop->location.id].memory) return CUDA_ERROR_OUT_OF_MEMORY;
    int dev = prop->location.id, shared = (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
    int charged = 0;
    struct stat st;
    char name[32];
    snprintf(name, sizeof name, "simgpu-vmm-dev%d", sim_phys(dev)); /* an importer learns the device */
    vmm_handle *h = calloc(1, sizeof *h);
    int fd = memfd_create(name, MFD_CLOEXEC);
    pthread_mutex_lock(&G.lock);
    if (!h || fd < 0 || ftruncate(fd, (off_t)size) != 0 || fstat(fd, &st) != 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto done;
    }
    if (sim_ensure_slot() < 0) {
        rc = CUDA_ERROR_OPERATING_SYSTEM;
        goto done;
    }
    /* a shareable allocation is the node's (its entry counts it once, whoever holds it) */
    if (shared ? sim_vmm_share_create(G.slot, sim_phys(dev), (uint64_t)st.st_ino, size, G.cfg->dev[dev].memory) != 0
               : sim_mem_charge(G.slot, sim_phys(dev), size, G.cfg->dev[dev].memory) != 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto done;
    }
    charged = 1;
    h->id = next_id++;
    h->fd = fd;
    h->size = size;
    h->dev = dev;
    h->charged = size;
    h->key = shared ? (uint64_t)st.st_ino : 0;
    h->refs = 1;
    h->prop = *prop;
    h->next = handles;
    handles = h;
    *handle = h->id;
done:
    pthread_mutex_unlock(&G.lock);
    if (!charged) {
        if (fd >= 0) close(fd);
        free(h);
    }
    return rc;
}

SIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    vmm_handle *h = find_handle(handle); /* a released handle is released no more */
    if (h) {
        h->refs--;
        free_if_unused_locked(h); /* still mapped: freed at its last unmap */
    }
    pthread_mutex_unlock(&G.lock);
    return h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                        unsigned long long flags) {
    if (!ptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (size == 0 || size % SIM_VMM_GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
    if (size > (1ull << 52)) return CUDA_ERROR_OUT_OF_MEMORY; /* more address space than a process can have */
    if (alignment == 0) alignment = SIM_VMM_GRANULARITY;
    if (alignment & (alignment - 1) || alignment > (1ull << 40)) return CUDA_ERROR_INVALID_VALUE;
    /* `addr` is only a hint (as for the real driver); over-reserve, then trim to the alignment. */
    size_t span = size + alignment;
    void *raw = mmap((void *)(uintptr_t)addr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = sim_align_up((uintptr_t)raw, alignment);
    if (base > (uintptr_t)raw) munmap(raw, base - (uintptr_t)raw);
    uintptr_t end = (uintptr_t)raw + span;
    if (end > base + size) munmap((void *)(base + size), end - (base + size));
    vmm_reserve *r = malloc(sizeof *r);
    if (!r) {
        munmap((void *)base, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&G.lock);
    *r = (vmm_reserve){.base = base, .size = size, .next = reserves};
    reserves = r;
    pthread_mutex_unlock(&G.lock);
    *ptr = (CUdeviceptr)base;
    return CUDA_SUCCESS;
}

/* Does [p, p+n) cover every mapping it meets whole? G.lock held. */
static int covers_whole_maps_locked(uintptr_t p, size_t n) {
    sim_alloc a;
    for (uintptr_t cur = p; cur < p + n;) {
        if (sim_alloc_find(cur, &a) == 0 && a.kind == ALLOC_VMM_MAP) {
            if (a.base < p || a.size > p + n - a.base) return 0;
            cur = a.base + a.size;
        } else {
            cur += SIM_VMM_GRANULARITY;
        }
    }
    return 1;
}

/* Drop the mappings that meet [p, p+n): each one's handle has one mapping fewer, and goes if it
 * was released. G.lock held. Returns how many were dropped. */
static int drop_maps_locked(uintptr_t p, size_t n) {
    int dropped = 0;
    sim_alloc a;
    uintptr_t cur = p;
    while (cur < p + n) {
        if (sim_alloc_find(cur, &a) == 0 && a.kind == ALLOC_VMM_MAP) {
            sim_alloc_remove(a.base, NULL);
            dropped++;
            cur = a.base + a.size;
            vmm_handle *h = find_any(a.handle);
            if (h) {
                h->maps--;
                free_if_unused_locked(h);
            }
        } else {
            cur += SIM_VMM_GRANULARITY;
        }
    }
    return dropped;
}

SIM_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    vmm_reserve **pp = &reserves;
    while (*pp && !((*pp)->base == (uintptr_t)ptr && (*pp)->size == size)) pp = &(*pp)->next;
    if (!*pp) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    vmm_reserve *r = *pp;
    *pp = r->next;
    drop_maps_locked(r->base, r->size);
    munmap((void *)r->base, r->size);
    free(r);
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (flags != 0 || size == 0 || size % SIM_VMM_GRANULARITY || offset % SIM_VMM_GRANULARITY ||
        ptr % SIM_VMM_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G.lock);
    vmm_handle *h = find_handle(handle);
    if (!h || offset > h->size || size > h->size - offset || !find_reserve((uintptr_t)ptr, size)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* no overlap with an existing mapping */
    for (uintptr_t cur = (uintptr_t)ptr; cur < (uintptr_t)ptr + size; cur += SIM_VMM_GRANULARITY) {
        if (sim_alloc_find(cur, NULL) == 0) {
            pthread_mutex_unlock(&G.lock);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    void *m = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset);
    sim_alloc a = {.base = (uintptr_t)ptr,
                   .size = size,
                   .dev = h->dev,
                   .kind = ALLOC_VMM_MAP,
                   .ctx = sim_current_ctx(),
                   .handle = h->id};
    if (m == MAP_FAILED || sim_alloc_insert(&a) != 0) {
        if (m != MAP_FAILED)
            mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
                 0);
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->maps++;
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (size == 0 || size % SIM_VMM_GRANULARITY || ptr % SIM_VMM_GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G.lock);
    /* whole mappings only, checked before anything is dropped: a refused unmap changes nothing */
    if (!find_reserve((uintptr_t)ptr, size) || !covers_whole_maps_locked((uintptr_t)ptr, size) ||
        drop_maps_locked((uintptr_t)ptr, size) == 0) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* back to an inaccessible part of the reservation */
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    if (!desc || count == 0 || size == 0 || size % SIM_VMM_GRANULARITY || ptr % SIM_VMM_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
            sim_check_device(desc[i].location.id) != CUDA_SUCCESS)
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            prot = PROT_READ | PROT_WRITE;
        else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ && prot == PROT_NONE)
            prot = PROT_READ;
        else if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ)
            return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&G.lock);
    /* every granule of the range must be mapped */
    for (uintptr_t cur = (uintptr_t)ptr; cur < (uintptr_t)ptr + size; cur += SIM_VMM_GRANULARITY) {
        sim_alloc a;
        if (sim_alloc_find(cur, &a) != 0 || a.kind != ALLOC_VMM_MAP) {
            pthread_mutex_unlock(&G.lock);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (mprotect((void *)(uintptr_t)ptr, size, prot) != 0) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (uintptr_t cur = (uintptr_t)ptr; cur < (uintptr_t)ptr + size;) {
        sim_alloc a;
        sim_alloc_find(cur, &a);
        sim_alloc_remove(a.base, NULL);
        a.accessible = prot == (PROT_READ | PROT_WRITE) ? 1 : 0;
        sim_alloc_insert(&a); /* same slot freed just above: cannot fail */
        cur = a.base + a.size;
    }
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    if (!handle || !addr) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    sim_alloc a;
    vmm_handle *h = NULL;
    /* a mapped address names its handle even after the handle was released: the mapping holds it */
    if (sim_alloc_find((uintptr_t)addr, &a) == 0 && a.kind == ALLOC_VMM_MAP) h = find_any(a.handle);
    if (h) {
        h->refs++;
        *handle = h->id;
    }
    pthread_mutex_unlock(&G.lock);
    return h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle) {
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    vmm_handle *h = find_handle(handle);
    if (h) *prop = h->prop;
    pthread_mutex_unlock(&G.lock);
    return h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags) {
    if (!shareableHandle || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED; /* Win32 / fabric handles: not on this system */
    pthread_mutex_lock(&G.lock);
    vmm_handle *h = find_handle(handle);
    int fd = -1;
    if (!h)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (!(h->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        rc = CUDA_ERROR_NOT_PERMITTED; /* not requested at cuMemCreate */
    else if ((fd = fcntl(h->fd, F_DUPFD_CLOEXEC, 0)) < 0)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_unlock(&G.lock);
    if (rc == CUDA_SUCCESS) *(int *)shareableHandle = fd;
    return rc;
}

/* The physical device a simulator memfd was created for; -1 if fd is not one. */
static int memfd_device(int fd) {
    char path[64], target[256];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n <= 0) return -1;
    target[n] = '\0';
    int phys;
    if (sscanf(target, "/memfd:simgpu-vmm-dev%d", &phys) != 1) return -1;
    return phys;
}

SIM_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                   CUmemAllocationHandleType shHandleType) {
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    int in = (int)(intptr_t)osHandle, phys = memfd_device(in), dev = -1;
    struct stat st;
    for (int d = 0; phys >= 0 && d < G.cfg->ndev; d++)
        if (sim_phys(d) == phys) dev = d;
    if (dev < 0 || fstat(in, &st) != 0 || st.st_size <= 0)
        return CUDA_ERROR_INVALID_VALUE; /* not an exported allocation of a visible device */
    vmm_handle *h = calloc(1, sizeof *h);
    int fd = fcntl(in, F_DUPFD_CLOEXEC, 0), held = 0;
    pthread_mutex_lock(&G.lock);
    if (!h || fd < 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto done;
    }
    if (sim_ensure_slot() < 0) {
        rc = CUDA_ERROR_OPERATING_SYSTEM;
        goto done;
    }
    /* this process holds the allocation from now on (once, however many handles it has of it); one
     * that no process holds any more was freed: the descriptor alone kept nothing */
    if (!holds_share(dev, (uint64_t)st.st_ino, NULL) && sim_vmm_share_hold(G.slot, phys, (uint64_t)st.st_ino) != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
        goto done;
    }
    held = 1;
    h->fd = fd;
    h->size = (size_t)st.st_size;
    h->dev = dev;
    h->key = (uint64_t)st.st_ino;
    h->refs = 1;
    h->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    h->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    h->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    h->prop.location.id = dev;
    h->id = next_id++;
    h->next = handles;
    handles = h;
    *handle = h->id;
done:
    pthread_mutex_unlock(&G.lock);
    if (!held) {
        if (fd >= 0) close(fd);
        free(h);
    }
    return rc;
}

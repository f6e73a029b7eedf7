/*
 * Internal API of libvgpu.so, shared by every file of the shim (memory accounting, compute cap).
 *
 * What a hook file (memory.c, launch_hooks.c, ...) can rely on:
 *  - Entries are added to hooks.def in the format documented at its top.
 *    For each entry you define `ret hook_<symbol> params` (hidden; the default visibility of
 *    the shim is hidden). dispatch.c generates the exported wrapper, real_<symbol> (the
 *    driver's function, NULL if the driver lacks it), and both maps (dlsym, cuGetProcAddress).
 *  - vgpu_init() runs the one-time setup (thread-safe, cheap after the first call) and returns
 *    CUDA_SUCCESS or the error the process fails closed with (bad config, unusable region).
 *    Call it first in every hook; if it fails, return its value without calling the driver.
 *    vgpu_config()->disabled (CUDA_DISABLE_CONTROL=true) means pure passthrough: call real_<symbol>.
 *  - vgpu_compute_init() (compute.c) is called
 *    once from vgpu_init() after the config is parsed and the real symbols are resolved, before
 *    the region is opened, and never when control is disabled. Parse your env there (use
 *    vgpu_config_error() to report a bad value: it prints the one line); return 0 if ok,
 *    nonzero if you reported a config error (cuInit then fails with CUDA_ERROR_INVALID_VALUE).
 *    Call vgpu_require_region() from it if the compute cap needs the shared region even when no
 *    memory limit is set.
 *  - vgpu_region() is the mapped accounting file (or NULL when no region is in use); your state
 *    is region->compute[device_index]. Use atomics on it, or vgpu_region_lock()/unlock() for
 *    short sections without system calls (robust: a dead holder is recovered by the next locker).
 *  - Device indices are as the application sees them (ordinal under CUDA_VISIBLE_DEVICES):
 *    vgpu_device_index(CUdevice) and vgpu_current_device_index(). They need cuInit to have
 *    succeeded; they return -1 otherwise.
 *  - vgpu_log(level, fmt, ...) prints "vgpu: ..." to stderr if level <= LIBCUDA_LOG_LEVEL.
 */
#ifndef VGPU_SHIM_INTERNAL_H
#define VGPU_SHIM_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vgpu/cuda_api.h"
#include "vgpu/nvml_api.h"
#include "vgpu/region.h"

#define VGPU_EXPORT __attribute__((visibility("default")))

/* fstat and memfd_create have no glibc symbol as old as the shim's bound (fstat@GLIBC_2.33,
 * memfd_create@GLIBC_2.27; see glibc_compat.h): the system calls themselves, whose struct stat
 * is glibc's on x86-64 and aarch64. */
static inline int vgpu_fstat(int fd, struct stat *st) { return (int)syscall(SYS_fstat, fd, st); }
static inline int vgpu_memfd_create(const char *name, unsigned int flags) {
    return (int)syscall(SYS_memfd_create, name, flags);
}

/* ---- the hooked symbols (generated from hooks.def) ---- */
#define VGPU_HOOK(lib, ret, name, params, args)                                                     \
    typedef ret(*vgpu_pfn_##name) params;                                                          \
    extern vgpu_pfn_##name real_##name;                                                            \
    ret hook_##name params;
#include "hooks.def"
#undef VGPU_HOOK

/* Resolve every real_<symbol> of lib CUDA (dispatch.c). Returns 0, or -1 if libcuda.so.1 cannot
 * be loaded (then the hooks return CUDA_ERROR_NOT_INITIALIZED or equivalent). */
int vgpu_resolve_cuda(void);
/* Resolve the real_<symbol> of lib NVML (lazily, at the first NVML hook). 0 ok, -1 no NVML. */
int vgpu_resolve_nvml(void);
/* A driver function we call but do not hook (cuDeviceGet, cuCtxGetDevice, nvmlDeviceGetIndex...),
 * from the same library instance; NULL if absent. Resolve once and cache the result. */
void *vgpu_cuda_sym(const char *name);
void *vgpu_nvml_sym(const char *name);
/* The C library's definition of `name` (what follows the shim: dlmopen.c's real dlmopen). */
void *vgpu_libc_sym(const char *name);
/* name@version from libdl.so.2, loading it first if no object has it (compat.c: a glibc older
 * than 2.34 whose process did not load libdl at start). NULL if it cannot. */
void *vgpu_compat_dl_sym(const char *name, const char *version);
/* 1 if compat.c loaded libdl.so.2 itself (outside the start-up scope RTLD_NEXT searches). */
int vgpu_compat_libdl_loaded_here(void);
/* Nanoseconds the last first-call setup took (init + device map), for benchmarks/debug. */
extern uint64_t vgpu_setup_ns;

/* ---- logging (log.c) ---- */
enum vgpu_log_level {
    VGPU_LOG_CONFIG = 0, /* configuration errors: always printed, whatever the level */
    VGPU_LOG_ERROR = 1,
    VGPU_LOG_WARN = 2, /* the default */
    VGPU_LOG_INFO = 3,
    VGPU_LOG_DEBUG = 4,
};
void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void vgpu_log_set_level(int level);
/* "4.00 GiB", "64.0 MiB", "512 B": the same as sharing.quantity.format_bytes. */
void vgpu_format_bytes(uint64_t n, char *buf, size_t len);

/* ---- configuration (config.c) ---- */
struct vgpu_config {
    int disabled;                        /* CUDA_DISABLE_CONTROL=true: pure passthrough */
    int log_level;                       /* LIBCUDA_LOG_LEVEL, default VGPU_LOG_WARN */
    int any_limit;                       /* some device has a memory limit */
    uint64_t limit[VGPU_MAX_DEVICES];    /* bytes per app-visible device index; 0 = none */
    uint64_t context_reserve;            /* VGPU_CONTEXT_RESERVE: the least charged per context */
    uint64_t context_size[VGPU_MAX_DEVICES]; /* VGPU_CONTEXT_SIZE(_<i>): expected context size, 0 none */
    char *region_path;                   /* CUDA_DEVICE_MEMORY_SHARED_CACHE (copied), NULL = private */
};
/* Parse the environment into cfg. Returns 0, or -1 after printing the one config-error line. */
int vgpu_config_load(struct vgpu_config *cfg);
/* The loaded configuration (valid after vgpu_init() returned CUDA_SUCCESS). */
const struct vgpu_config *vgpu_config(void);
/* Print the one config-error line: "vgpu: VAR=VALUE is invalid: WHY; accepted: FORMS". */
void vgpu_config_error(const char *var, const char *value, const char *why, const char *forms);
/* PREFIX (every device) and PREFIX_<i> (device i, 0..VGPU_MAX_DEVICES-1) from the settings: out[i] is device i's
 * parsed value (PREFIX_<i> over PREFIX, 0 when neither is set), have[i] (may be NULL) whether one
 * was set. Another index, or a value `parse` refuses, is a config error: -1 after the line. */
typedef int (*vgpu_setting_parser)(const char *var, const char *value, uint64_t *out);
int vgpu_indexed_settings(const char *prefix, vgpu_setting_parser parse, uint64_t out[VGPU_MAX_DEVICES],
                          int have[VGPU_MAX_DEVICES]);
/* Memory quantity parser: exactly the forms of sharing/quantity.py. 0 ok, -1 malformed or
 * out of range (then *why says which). */
int vgpu_parse_bytes(const char *text, uint64_t *out, const char **why);
extern const char vgpu_quantity_forms[];

/* ---- where limit settings come from (settings.c) ---- */
/* The plugin's read-only limits file, in the container beside the shim's container path. */
#define VGPU_LIMITS_CONTAINER_PATH "/usr/local/lib/vgpu-sharing/limits"
/* Find the limits file (beside the loaded shim, then VGPU_LIMITS_CONTAINER_PATH): only the plugin's
 * read-only bind mount counts. 0 (with or without one), -1 when one exists but cannot be used or
 * is not the plugin's, or the plugin's mounts are here but not where the shim looks (reported:
 * fail closed). */
int vgpu_settings_load(void);
/* What this process enforces, for its slot of the accounting file (region.h, VGPU_LIMITS_*). */
void vgpu_settings_publish(uint32_t *source, uint64_t *dev, uint64_t *ino, uint64_t *hash);
/* A setting's value: from the limits file when one is in force and the name is a limit setting
 * (every one but LIBCUDA_LOG_LEVEL), else from the environment. NULL when unset. */
const char *vgpu_setting(const char *name);
/* The "K=V" entries settings are read from (the limits file's, or environ). */
char **vgpu_setting_entries(void);
const char *vgpu_settings_file(void); /* the limits file in force, or NULL */
int vgpu_setting_is_controlled(const char *name);
/* Log once where the limits come from and which environment settings were ignored. */
void vgpu_settings_report(void);

/* ---- files in shared directories (safefile.c) ---- */
/* Open the directory of `path` (links in the directory's path are followed) and put the last
 * component in base. The descriptor, or -1 with *why set. */
int vgpu_dir_open(const char *path, char *base, size_t baselen, char *why, size_t len);
/* A directory we may create or open files in: owned by us or root, and if others may write it,
 * sticky (*shared = 1 then). 0, or -1 with *why. */
int vgpu_dir_check(int dfd, int *shared, char *why, size_t len);
/* An opened file we may use: regular, and in a shared directory owned by us or root. */
int vgpu_file_check(int fd, int dir_shared, char *why, size_t len);
/* A one-line reason for an open() errno (ELOOP: a link, refused). */
const char *vgpu_open_error(int err);

/* ---- initialisation (init.c) ---- */
CUresult vgpu_init(void);
/* Called by the compute cap's init when it needs the region without memory limits. */
void vgpu_require_region(void);
int vgpu_compute_init(void); /* compute.c: parses the compute cap's settings */

/* ---- devices (devices.c) ---- */
/* Build the CUdevice <-> app index map (once, after a successful real cuInit). */
void vgpu_devices_discover(void);
/* App-visible index; -1: not a device (the driver's error follows); VGPU_DEVICE_UNACCOUNTED: one
 * of the driver's devices past the first VGPU_MAX_DEVICES, which have no account (memory on it
 * is refused while a limit is set: vgpu_mem_unaccounted). */
#define VGPU_DEVICE_UNACCOUNTED (-2)
int vgpu_device_index(CUdevice dev);
int vgpu_current_device_index(void);    /* of the current context's device, or -1 (no context) / -2 */
int vgpu_device_unaccounted_ordinal(void); /* the ordinal of the last -2 answer (for a log line) */
int vgpu_device_handle(int idx, CUdevice *out); /* the CUdevice of index idx: 0, or -1 */
/* The app-visible index of an NVML device handle, or -1 (not visible, or unknown): by UUID
 * against the map when CUDA is initialised in the process; else from CUDA_VISIBLE_DEVICES (UUID
 * entries; numeric ones only when CUDA's order is known to be NVML's). Never initialises CUDA. */
int vgpu_nvml_device_index(nvmlDevice_t dev);

/* ---- the accounting region (region.c) ---- */
struct vgpu_region *vgpu_region(void);  /* NULL when no region is in use */
/* Open (or create) the region: path, or a private memfd when path is NULL. Returns CUDA_SUCCESS
 * or an error after printing one line. */
CUresult vgpu_region_open(const char *path);
/* 0 locked (never fails: a dead, hung or garbage holder is taken over within 2 s; callers keep
 * their check of the result). */
int vgpu_region_lock(void);
void vgpu_region_unlock(void);
/* Reserve bytes on device index dev against limit (0 = none). Returns 0, or -1 if over quota
 * (after a dead-slot scan). *used_out gets the slice's usage seen at the decision. */
int vgpu_region_charge(int dev, uint64_t bytes, uint64_t limit, uint64_t *used_out);
/* The quota of device index dev (the configuration's: never the writable region's). */
uint64_t vgpu_region_limit(int dev);
void vgpu_region_uncharge(int dev, uint64_t bytes);
uint64_t vgpu_region_used(int dev);
/* This process's charge on device index dev (UINT64_MAX without a slot: none yet, or exiting). */
uint64_t vgpu_region_mine(int dev);
/* A context's size on device index dev as the slice learned it (region.h): the bytes, and in
 * *source how it was measured (VGPU_CONTEXT_*). Tenant-writable: the caller bounds it. */
uint64_t vgpu_region_context(int dev, uint32_t *source);
/* Claim the measurement of dev's context size: 1 ours (publish must follow), 0 a live process of
 * the slice measures it (*seen: its word, to wait on), -1 no slot (measure without a claim). */
int vgpu_region_context_claim(int dev, uint32_t *seen);
/* Sleep until the measurer word of dev changes from seen, at most ns. */
void vgpu_region_context_wait(int dev, uint32_t seen, uint64_t ns);
/* Publish a measurement (source VGPU_CONTEXT_UNKNOWN: none, only drop the claim) of a device of
 * total bytes (0 unknown) and, if claimed, drop our claim and wake the waiters. */
void vgpu_region_context_publish(int dev, uint64_t bytes, uint32_t source, uint64_t total, int claimed);
/* Return the charges of dead processes to the quota (system calls: not on every call). */
void vgpu_region_reclaim_dead(void);
/* Fork child: drop the inherited slot (claim a new one lazily). */
void vgpu_region_atfork_child(void);

/* ---- per-process record of what was charged (track.c) ---- */
enum vgpu_track_kind {
    VGPU_TRACK_PTR = 1,    /* cuMemAlloc*, cuMemAllocManaged, cuMemAllocPitch, async allocations */
    VGPU_TRACK_HANDLE = 2, /* cuMemCreate handles: aux = cuMemRetainAllocationHandle references (vmm.c) */
    VGPU_TRACK_ARRAY = 3,
    VGPU_TRACK_MIPMAP = 4,
    VGPU_TRACK_CTX = 5,    /* contexts' reserve */
    VGPU_TRACK_ASYNC = 6,  /* stream-ordered allocations: key ptr, aux = its pool's record (pools.c) */
};
int vgpu_track_add(int kind, uint64_t key, int dev, uint64_t bytes); /* 0, or -1 out of memory */
int vgpu_track_take(int kind, uint64_t key, int *dev, uint64_t *bytes); /* 1 found+removed, 0 not */
/* The same with one more word per record (pools.c: the allocation's pool). */
int vgpu_track_add_aux(int kind, uint64_t key, int dev, uint64_t bytes, uint64_t aux);
int vgpu_track_take_aux(int kind, uint64_t key, int *dev, uint64_t *bytes, uint64_t *aux);
void vgpu_track_reset(void); /* fork child: the parent's allocations are not ours */

/* ---- memory accounting helpers (memory.c) ---- */
/* Is memory accounting on (a region is in use and control not disabled)? */
int vgpu_mem_active(void);
/* Reserve bytes on dev, printing the once-per-process denial line on refusal.
 * CUDA_SUCCESS or CUDA_ERROR_OUT_OF_MEMORY. */
CUresult vgpu_mem_reserve(int dev, uint64_t bytes);
void vgpu_mem_release(int dev, uint64_t bytes);
/* The device's page size as the driver reports it (cuMemGetAllocationGranularity), 0 if it
 * answered nothing. */
uint64_t vgpu_mem_page(int dev);
/* What an allocation of size bytes takes at most on device index dev, from what the driver
 * reports (a page-rounded size from half a page up, else its allocation alignment). */
uint64_t vgpu_mem_estimate(int dev, uint64_t size);
/* An allocation on a device past VGPU_MAX_DEVICES (index VGPU_DEVICE_UNACCOUNTED): refused with
 * CUDA_ERROR_OUT_OF_MEMORY while a memory limit is set (one log line per process), else
 * CUDA_SUCCESS (the driver's, unaccounted). */
CUresult vgpu_mem_unaccounted(void);

/* ---- a context's own device memory, learned from the driver (ctxmem.c) ---- */
#define VGPU_CTXMEM_PIDS 256
struct vgpu_ctxmem_probe { /* the driver's readings before a context is created */
    int dev, first, have_dev, have_self, have_pids, exact;
    int learned; /* the slice knew the size: charge is charged, nothing is read */
    int hinted;  /* measuring for the slice with VGPU_CONTEXT_SIZE charged: verified by a thread */
    int plugin;  /* the plugin's VGPU_CONTEXT_SIZE_<i> (limits file) charged: NVML not asked */
    int claimed; /* this process measures for the slice: publish (or drop) the claim */
    uint64_t charge, cuda_total; /* cuda_total: the device's memory by the driver, 0 unknown */
    uint64_t dev_used, total, self_used;
    uint64_t pub_bytes;  /* measured by vgpu_ctxmem_after, published by vgpu_ctxmem_done */
    uint32_t pub_source; /* VGPU_CONTEXT_*: UNKNOWN when there is nothing to publish */
    unsigned npids, pids[VGPU_CTXMEM_PIDS];
};
/* Before a context on device index dev is created: what to reserve for it. The slice's learned
 * size when it knows one (p->learned: nothing else to do, vgpu_ctxmem_after returns it), waiting
 * for another process of the slice that is measuring it (as long as it lives); else the
 * estimate, and the caller reads the driver (vgpu_ctxmem_before). Callers serialise context
 * creation in the process; after vgpu_ctxmem_expect, either vgpu_ctxmem_cancel, or
 * vgpu_ctxmem_after then vgpu_ctxmem_done. */
uint64_t vgpu_ctxmem_expect(struct vgpu_ctxmem_probe *p, int dev, CUdevice cudev);
/* Read the driver before creating a context (first: the process has no context on it). */
void vgpu_ctxmem_before(struct vgpu_ctxmem_probe *p, CUdevice cudev, int first);
/* The context was not created (or not reserved for): drop a claim to measure it. */
void vgpu_ctxmem_cancel(struct vgpu_ctxmem_probe *p);
/* After the context was created: the bytes to charge for it (at least VGPU_CONTEXT_RESERVE). */
uint64_t vgpu_ctxmem_after(struct vgpu_ctxmem_probe *p);
/* A context that exists already (created out of the shim's sight): its size from this
 * process's NVML entry, 0 unknown; instead of vgpu_ctxmem_before/after, then vgpu_ctxmem_done. */
uint64_t vgpu_ctxmem_existing(struct vgpu_ctxmem_probe *p, CUdevice cudev);
/* After the caller settled the charge (or destroyed a context that did not fit): publish what
 * was measured for the slice and wake the processes waiting for it. Until then nobody else of
 * the slice creates a context on the device, so a context never exists uncharged beside them. */
void vgpu_ctxmem_done(struct vgpu_ctxmem_probe *p);
/* At a normal exit, before the slot is given back: conclude (briefly) or drop a verification of
 * a handed-over size that is under way. */
void vgpu_ctxmem_at_exit(void);

/* ---- primary contexts the CUDA runtime retains out of the shim's sight (context.c) ---- */
/* The runtime's private table was handed out (exporttab.c): from now on adopt such contexts. */
void vgpu_primary_runtime_route(void);
/* Before a charge or a cuMemGetInfo on device index idx: charge its primary context if it is
 * active and the process has not charged it (a no-op outside runtime processes). */
void vgpu_primary_adopt(int idx);

/* ---- memory pools (pools.c) ---- */
/* Settle every (idle) pool of device index dev to what it reserves; trim them first if trim.
 * Returns nonzero if some charge was returned. */
int vgpu_pools_settle(int dev, int trim);
void vgpu_pools_atfork_child(void);
/* cuMemFree of a pointer that is not a cuMemAlloc one: a stream-ordered allocation is freed
 * and its pool settled; anything else just goes to real_free. */
CUresult vgpu_pools_free_sync(CUdeviceptr dptr, CUresult (*real_free)(CUdeviceptr));

/* ---- graph memory (graphmem.c) ---- */
/* Settle device index dev's graph memory pool charge to what it reserves; trim it first if
 * trim. Nonzero if some charge was returned. */
int vgpu_graphmem_settle(int dev, int trim);
/* Is the stream capturing (cuStreamIsCapturing, or its _ptsz form)? Captured stream-ordered
 * allocations take no memory until the graph is launched. */
int vgpu_graphmem_capturing(CUstream s, int ptsz);
/* The compute cap's graph launch paths (launch_hooks.c), called by graphmem.c's hooks. */
CUresult vgpu_launch_graph(CUgraphExec g, CUstream s);
CUresult vgpu_launch_graph_ptsz(CUgraphExec g, CUstream s);

/* ---- module globals (modules.c) ---- */
/* Reserve what the driver takes for an allocation of size on dev (*charged bytes, *unit its
 * share of the small-allocation pages, or 0), and give it back (memory.c). */
CUresult vgpu_mem_take(int dev, uint64_t size, uint64_t *charged, uint64_t *unit);
void vgpu_mem_give_back(int dev, uint64_t bytes, uint64_t unit);
/* A context was destroyed (rc: the driver's answer, returned): its modules' globals go back. */
CUresult vgpu_modules_ctx_gone(CUcontext ctx, CUresult rc);
/* A device's primary context was reset (reset) or released: if it is gone, so are its modules. */
CUresult vgpu_modules_primary_gone(CUdevice dev, int reset, CUresult rc);

#endif

/*
 * Device identity as the application sees it: index i = the i-th device CUDA enumerates
 * (cuDeviceGet(i), i.e. position under CUDA_VISIBLE_DEVICES, which need not start at 0, in
 * CUDA_DEVICE_ORDER, which need not be NVML's PCI order).
 * Quotas (CUDA_DEVICE_MEMORY_LIMIT_<i>) and the region's counters are keyed by this index.
 */
#include <ctype.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "devices.h"
#include "vgpu/region.h"
#include "log.h"
#include "symbols.h"

typedef CUresult (*count_fn)(int *);
typedef CUresult (*get_fn)(CUdevice *, int);
typedef CUresult (*ctxdev_fn)(CUdevice *);

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int discovered;          /* set once the map is built (cuDeviceGetCount succeeded) */
static int ndev;                /* devices mapped: min(driver's count, VGPU_MAX_DEVICES) */
static int ndev_driver;         /* the driver's count: ordinals [ndev, ndev_driver) have no account */
static int unaccounted_ordinal; /* the last ordinal vgpu_device_index found unaccounted (for the log line;
                                * no thread-local storage in a preloaded library) */
static CUdevice handles[VGPU_MAX_DEVICES];
static ctxdev_fn ctx_get_device;
typedef CUresult (*uuid_fn)(CUuuid *, CUdevice);
static unsigned char uuids[VGPU_MAX_DEVICES][16]; /* of each ordinal, when have_uuids */
static int have_uuids;

void vgpu_devices_discover(void) {
    if (__atomic_load_n(&discovered, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&mu);
    if (!discovered) {
        count_fn count = (count_fn)vgpu_cuda_sym("cuDeviceGetCount");
        get_fn get = (get_fn)vgpu_cuda_sym("cuDeviceGet");
        ctx_get_device = (ctxdev_fn)vgpu_cuda_sym("cuCtxGetDevice");
        int n = 0;
        /* before a successful cuInit this fails: stay undiscovered and retry next time */
        if (count && get && ctx_get_device && count(&n) == CUDA_SUCCESS) {
            int total = n;
            if (n > VGPU_MAX_DEVICES) n = VGPU_MAX_DEVICES; /* the rest: refused memory under a limit */
            int ok = 1;
            for (int i = 0; i < n && ok; i++) ok = get(&handles[i], i) == CUDA_SUCCESS;
            /* each ordinal's UUID: how NVML handles are matched to ordinals (below) */
            uuid_fn get_uuid = (uuid_fn)vgpu_cuda_sym("cuDeviceGetUuid_v2");
            if (get_uuid == NULL) get_uuid = (uuid_fn)vgpu_cuda_sym("cuDeviceGetUuid");
            int uuids_ok = get_uuid != NULL;
            for (int i = 0; i < n && ok && uuids_ok; i++) {
                CUuuid u;
                uuids_ok = get_uuid(&u, handles[i]) == CUDA_SUCCESS;
                if (uuids_ok) memcpy(uuids[i], u.bytes, 16);
            }
            if (ok) {
                have_uuids = uuids_ok;
                ndev = n;
                ndev_driver = total;
                __atomic_store_n(&discovered, 1, __ATOMIC_RELEASE);
            }
        }
    }
    pthread_mutex_unlock(&mu);
}

int vgpu_device_only_one(void) { return __atomic_load_n(&discovered, __ATOMIC_ACQUIRE) && ndev_driver == 1; }

int vgpu_device_index(CUdevice dev) {
    vgpu_devices_discover();
    if (!__atomic_load_n(&discovered, __ATOMIC_ACQUIRE)) return -1;
    if (dev >= 0 && dev < ndev && handles[dev] == dev) return dev; /* handles are ordinals in practice */
    for (int i = 0; i < ndev; i++)
        if (handles[i] == dev) return i;
    if (dev >= ndev && dev < ndev_driver) { /* a device of the driver's past our tables */
        __atomic_store_n(&unaccounted_ordinal, dev, __ATOMIC_RELAXED);
        return VGPU_DEVICE_UNACCOUNTED;
    }
    return -1;
}

int vgpu_device_unaccounted_ordinal(void) { return __atomic_load_n(&unaccounted_ordinal, __ATOMIC_RELAXED); }

int vgpu_device_handle(int idx, CUdevice *out) {
    vgpu_devices_discover();
    if (!__atomic_load_n(&discovered, __ATOMIC_ACQUIRE) || idx < 0 || idx >= ndev) return -1;
    *out = handles[idx];
    return 0;
}

int vgpu_current_device_index(void) {
    vgpu_devices_discover();
    if (!__atomic_load_n(&discovered, __ATOMIC_ACQUIRE)) return -1;
    CUdevice d;
    if (ctx_get_device(&d) != CUDA_SUCCESS) return -1;
    return vgpu_device_index(d);
}

/* ---- NVML handles -> the application's index ----
 *
 * NVML enumerates in PCI bus order and ignores CUDA_VISIBLE_DEVICES; CUDA enumerates in
 * CUDA_DEVICE_ORDER (FASTEST_FIRST by default) and numeric CUDA_VISIBLE_DEVICES entries index
 * that order. So NVML index i is not, in general, CUDA ordinal i, and only the UUID names a
 * device for both. With CUDA initialised in this process, the map above records each ordinal's
 * UUID and the NVML handle is matched by its UUID. Without CUDA (an NVML-only tool such as
 * nvidia-smi) the shim does not initialise CUDA itself: a cuInit before a fork makes CUDA
 * unusable in the child with the real driver, and programs (PyTorch among them) use NVML
 * precisely to avoid that. It reads CUDA_VISIBLE_DEVICES instead: UUID entries match by UUID
 * (the DRA driver always writes UUIDs); numeric entries, and an unset variable, only when the
 * CUDA order is known to be NVML's (CUDA_DEVICE_ORDER=PCI_BUS_ID, or a single device).
 * Otherwise the device is unknown: no slice view (the driver's numbers pass through) rather
 * than possibly another device's. */
typedef nvmlReturn_t (*nvml_uuid_fn)(nvmlDevice_t, char *, unsigned int);
typedef nvmlReturn_t (*nvml_index_fn)(nvmlDevice_t, unsigned int *);
typedef nvmlReturn_t (*nvml_count_fn)(unsigned int *);
typedef nvmlReturn_t (*nvml_handle_fn)(unsigned int, nvmlDevice_t *);

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" -> 16 bytes; 0 ok, -1 not a GPU UUID. */
static int parse_gpu_uuid(const char *s, unsigned char out[16]) {
    if (strncmp(s, "GPU-", 4) != 0) return -1;
    s += 4;
    int n = 0;
    for (; *s && n < 32; s++) {
        if (*s == '-') continue;
        int v = isdigit((unsigned char)*s) ? *s - '0'
                : (*s >= 'a' && *s <= 'f') ? *s - 'a' + 10
                : (*s >= 'A' && *s <= 'F') ? *s - 'A' + 10
                                           : -1;
        if (v < 0) return -1;
        if (n % 2 == 0)
            out[n / 2] = (unsigned char)(v << 4);
        else
            out[n / 2] |= (unsigned char)v;
        n++;
    }
    return n == 32 && *s == '\0' ? 0 : -1;
}

/* Resolve an NVML function once (racing threads resolve the same pointer). */
static void *nvml_fn(void **slot, const char *name) {
    void *f = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (f == NULL) {
        f = vgpu_nvml_sym(name);
        __atomic_store_n(slot, f, __ATOMIC_RELEASE);
    }
    return f;
}

/* Is the CUDA order of all devices known to be NVML's (PCI bus) order without asking CUDA? */
static int cuda_order_is_pci(void) {
    const char *o = getenv("CUDA_DEVICE_ORDER");
    if (o != NULL && strcmp(o, "PCI_BUS_ID") == 0) return 1;
    static void *count_p;
    nvml_count_fn count = (nvml_count_fn)nvml_fn(&count_p, "nvmlDeviceGetCount_v2");
    unsigned int n = 0;
    return count != NULL && count(&n) == NVML_SUCCESS && n == 1; /* one device: one order */
}

/* Does exactly one NVML device's UUID start with prefix (CUDA ignores an ambiguous entry and
 * the list ends there)? In doubt (NVML cannot enumerate), no. */
static int uuid_prefix_unique(const char *prefix, size_t len) {
    static void *count_p, *handle_p, *uuid_p;
    nvml_count_fn count = (nvml_count_fn)nvml_fn(&count_p, "nvmlDeviceGetCount_v2");
    nvml_handle_fn handle = (nvml_handle_fn)nvml_fn(&handle_p, "nvmlDeviceGetHandleByIndex_v2");
    nvml_uuid_fn get_uuid = (nvml_uuid_fn)nvml_fn(&uuid_p, "nvmlDeviceGetUUID");
    unsigned int n = 0;
    if (count == NULL || handle == NULL || get_uuid == NULL || count(&n) != NVML_SUCCESS) return 0;
    int matches = 0;
    for (unsigned int i = 0; i < n; i++) {
        nvmlDevice_t d;
        char u[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
        if (handle(i, &d) != NVML_SUCCESS || get_uuid(d, u, sizeof u) != NVML_SUCCESS) return 0;
        u[sizeof u - 1] = '\0';
        if (strncmp(u, prefix, len) == 0) matches++;
    }
    return matches == 1;
}

/* Without CUDA: the position of the device (NVML index, UUID) in CUDA_VISIBLE_DEVICES, or -1. */
static int index_without_cuda(nvmlDevice_t dev, const char *uuid) {
    static void *index_p;
    nvml_index_fn get_index = (nvml_index_fn)nvml_fn(&index_p, "nvmlDeviceGetIndex");
    unsigned int nvml_index = 0;
    int have_index = get_index != NULL && get_index(dev, &nvml_index) == NVML_SUCCESS;
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (cvd == NULL) /* every device, in CUDA order */
        return have_index && nvml_index < VGPU_MAX_DEVICES && cuda_order_is_pci() ? (int)nvml_index : -1;
    /* CUDA's rules: comma-separated indices or UUID (prefixes); the list ends at the first entry
     * that is neither. */
    int pos = 0;
    const char *p = cvd;
    while (*p && pos < VGPU_MAX_DEVICES) {
        while (*p == ' ') p++;
        const char *start = p;
        while (*p && *p != ',') p++;
        size_t len = (size_t)(p - start);
        while (len > 0 && start[len - 1] == ' ') len--;
        if (len == 0) break;
        if (isdigit((unsigned char)start[0])) {
            char *end;
            long v = strtol(start, &end, 10);
            if ((size_t)(end - start) != len || v < 0) break;
            /* an index into CUDA's order: it might name this device or not, unless that order
             * is known to be NVML's */
            if (!have_index || !cuda_order_is_pci()) return -1;
            if ((unsigned long)v == nvml_index) return pos;
        } else if (len >= 4 && (strncmp(start, "GPU-", 4) == 0 || strncmp(start, "MIG-", 4) == 0)) {
            if (uuid[0] && strncmp(uuid, start, len) == 0) return uuid_prefix_unique(start, len) ? pos : -1;
        } else {
            break;
        }
        pos++;
        if (*p == ',') p++;
    }
    return -1; /* not visible to the application */
}

int vgpu_nvml_device_index(nvmlDevice_t dev) {
    static void *uuid_p;
    nvml_uuid_fn get_uuid = (nvml_uuid_fn)nvml_fn(&uuid_p, "nvmlDeviceGetUUID");
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "";
    if (get_uuid == NULL || get_uuid(dev, uuid, sizeof uuid) != NVML_SUCCESS) uuid[0] = '\0';
    uuid[sizeof uuid - 1] = '\0';
    if (__atomic_load_n(&discovered, __ATOMIC_ACQUIRE) && have_uuids) {
        /* CUDA is initialised here: its own answer, by UUID */
        unsigned char b[16];
        if (parse_gpu_uuid(uuid, b) != 0) return -1;
        for (int i = 0; i < ndev; i++)
            if (memcmp(uuids[i], b, 16) == 0) return i;
        return -1; /* not one of the application's devices */
    }
    return index_without_cuda(dev, uuid);
}

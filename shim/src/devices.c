/*
 * Device identity as the application sees it: index i = the i-th device CUDA enumerates
 * (cuDeviceGet(i), i.e. position under CUDA_VISIBLE_DEVICES, which need not start at 0).
 * Quotas (CUDA_DEVICE_MEMORY_LIMIT_<i>) and the region's counters are keyed by this index.
 */
#include <ctype.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "shim_internal.h"

typedef CUresult (*count_fn)(int *);
typedef CUresult (*get_fn)(CUdevice *, int);
typedef CUresult (*ctxdev_fn)(CUdevice *);

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int discovered; /* set once the map is built (cuDeviceGetCount succeeded) */
static int ndev;
static CUdevice handles[VGPU_MAX_DEVICES];
static ctxdev_fn ctx_get_device;

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
            if (n > VGPU_MAX_DEVICES) {
                vgpu_log(VGPU_LOG_WARN, "%d devices visible; only the first %d are accounted", n, VGPU_MAX_DEVICES);
                n = VGPU_MAX_DEVICES;
            }
            int ok = 1;
            for (int i = 0; i < n && ok; i++) ok = get(&handles[i], i) == CUDA_SUCCESS;
            if (ok) {
                ndev = n;
                __atomic_store_n(&discovered, 1, __ATOMIC_RELEASE);
            }
        }
    }
    pthread_mutex_unlock(&mu);
}

int vgpu_device_count(void) { return __atomic_load_n(&discovered, __ATOMIC_ACQUIRE) ? ndev : 0; }

int vgpu_device_index(CUdevice dev) {
    vgpu_devices_discover();
    if (!__atomic_load_n(&discovered, __ATOMIC_ACQUIRE)) return -1;
    if (dev >= 0 && dev < ndev && handles[dev] == dev) return dev; /* handles are ordinals in practice */
    for (int i = 0; i < ndev; i++)
        if (handles[i] == dev) return i;
    return -1;
}

int vgpu_current_device_index(void) {
    vgpu_devices_discover();
    if (!__atomic_load_n(&discovered, __ATOMIC_ACQUIRE)) return -1;
    CUdevice d;
    if (ctx_get_device(&d) != CUDA_SUCCESS) return -1;
    return vgpu_device_index(d);
}

/* ---- NVML handles: NVML ignores CUDA_VISIBLE_DEVICES, so map through it ourselves ---- */
typedef nvmlReturn_t (*nvml_index_fn)(nvmlDevice_t, unsigned int *);
typedef nvmlReturn_t (*nvml_uuid_fn)(nvmlDevice_t, char *, unsigned int);

int vgpu_nvml_device_index(nvmlDevice_t dev) {
    static nvml_index_fn get_index;
    static nvml_uuid_fn get_uuid;
    if (get_index == NULL) get_index = (nvml_index_fn)vgpu_nvml_sym("nvmlDeviceGetIndex");
    if (get_uuid == NULL) get_uuid = (nvml_uuid_fn)vgpu_nvml_sym("nvmlDeviceGetUUID");
    unsigned int nvml_index;
    if (get_index == NULL || get_index(dev, &nvml_index) != NVML_SUCCESS) return -1;
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (cvd == NULL) return nvml_index < VGPU_MAX_DEVICES ? (int)nvml_index : -1;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "";
    if (get_uuid != NULL && get_uuid(dev, uuid, sizeof uuid) != NVML_SUCCESS) uuid[0] = '\0';
    /* CUDA's rules: comma-separated indices or UUID (prefixes); the list ends at the first
     * entry that is neither. */
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
            if ((unsigned long)v == nvml_index) return pos;
        } else if (len >= 4 && (strncmp(start, "GPU-", 4) == 0 || strncmp(start, "MIG-", 4) == 0)) {
            if (uuid[0] && strncmp(uuid, start, len) == 0) return pos;
        } else {
            break;
        }
        pos++;
        if (*p == ',') p++;
    }
    return -1; /* not visible to the application */
}

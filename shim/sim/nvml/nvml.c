/* NVML init/shutdown, system queries and device identity, PCI and memory queries. */
#include "nvml.h"

#include "../common/config.h"
#include "../common/observe.h"
#include "../common/state.h"
#include "../common/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

nvml_globals N = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* fork: a child must not inherit N.lock held by a thread it does not have. NVML state (init
 * count, config) is inherited as is: NVML keeps working in the child. */
static void atfork_prepare(void) { pthread_mutex_lock(&N.lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&N.lock); }
static void atfork_child(void) { pthread_mutex_init(&N.lock, NULL); }

__attribute__((constructor)) static void sim_nvml_ctor(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

#define PCI_DEVICE_ID    0x233010DEu /* H100 SXM5 (0x2330) by NVIDIA (0x10DE) */
#define PCI_SUBSYSTEM_ID 0x16C110DEu

nvmlReturn_t sim_nvml_check_init(void) {
    pthread_mutex_lock(&N.lock);
    int ok = N.refcount > 0;
    pthread_mutex_unlock(&N.lock);
    return ok ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

nvmlReturn_t sim_nvml_device(nvmlDevice_t h, int *idx, sim_device_cfg *cfg) {
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&N.lock);
    if (N.refcount <= 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else if (!h || h < &N.devs[0] || h >= &N.devs[N.cfg.ndev])
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else {
        *idx = h->index;
        if (cfg) *cfg = N.cfg.dev[h->index];
    }
    pthread_mutex_unlock(&N.lock);
    return rc;
}

uint64_t sim_nvml_period_ns(void) {
    uint64_t ms = sim_env_u64("SIMGPU_UTIL_PERIOD_MS", 1000);
    if (ms < 20) ms = 20;
    if (ms > 10000) ms = 10000;
    return ms * 1000000ull;
}

SIM_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    if (flags & ~(unsigned)(NVML_INIT_FLAG_NO_GPUS | NVML_INIT_FLAG_NO_ATTACH)) return NVML_ERROR_INVALID_ARGUMENT;
    sim_config *cfg = malloc(sizeof *cfg);
    if (!cfg) return NVML_ERROR_MEMORY;
    /* Re-read at every init: tests change devices or health between runs. */
    if (sim_config_load(cfg) != 0) {
        free(cfg);
        return NVML_ERROR_UNKNOWN;
    }
    pthread_mutex_lock(&N.lock);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (sim_state_open() != 0) {
        rc = NVML_ERROR_UNKNOWN;
    } else if (cfg->ndev == 0 && !(flags & NVML_INIT_FLAG_NO_GPUS)) {
        rc = NVML_ERROR_GPU_NOT_FOUND;
    } else {
        N.cfg = *cfg;
        N.cfg_mtime = sim_config_mtime_ns(cfg->path);
        for (int i = 0; i < SIM_MAX_DEVICES; i++) N.devs[i].index = i;
        N.refcount++;
    }
    pthread_mutex_unlock(&N.lock);
    free(cfg);
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
SIM_EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

SIM_EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&N.lock);
    nvmlReturn_t rc = N.refcount > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (N.refcount > 0) N.refcount--;
    pthread_mutex_unlock(&N.lock);
    return rc;
}

static nvmlReturn_t put_str(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = sim_nvml_check_init();
    if (rc != NVML_SUCCESS) return rc;
    char v[80];
    pthread_mutex_lock(&N.lock);
    sim_copy_str(v, sizeof v, N.cfg.driver_version);
    pthread_mutex_unlock(&N.lock);
    return put_str(version, length, v);
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = sim_nvml_check_init();
    if (rc != NVML_SUCCESS) return rc;
    char v[100];
    pthread_mutex_lock(&N.lock);
    snprintf(v, sizeof v, "%d.%s", N.cfg.cuda_version / 1000, N.cfg.driver_version);
    pthread_mutex_unlock(&N.lock);
    return put_str(version, length, v);
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = sim_nvml_check_init();
    if (rc != NVML_SUCCESS) return rc;
    pthread_mutex_lock(&N.lock);
    *cudaDriverVersion = N.cfg.cuda_version;
    pthread_mutex_unlock(&N.lock);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&N.lock);
    if (N.refcount <= 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        *deviceCount = (unsigned)N.cfg.ndev;
    pthread_mutex_unlock(&N.lock);
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&N.lock);
    if (N.refcount <= 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else if (index >= (unsigned)N.cfg.ndev)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else
        *device = &N.devs[index];
    pthread_mutex_unlock(&N.lock);
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = NVML_ERROR_NOT_FOUND;
    pthread_mutex_lock(&N.lock);
    if (N.refcount <= 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        for (int i = 0; i < N.cfg.ndev; i++)
            if (strcmp(N.cfg.dev[i].uuid, uuid) == 0) {
                *device = &N.devs[i];
                rc = NVML_SUCCESS;
            }
    pthread_mutex_unlock(&N.lock);
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    if (!pciBusId || !device) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned dom = 0, bus, dev, fn;
    char tail;
    if (sscanf(pciBusId, "%x:%x:%x.%x%c", &dom, &bus, &dev, &fn, &tail) != 4) {
        dom = 0;
        if (sscanf(pciBusId, "%x:%x.%x%c", &bus, &dev, &fn, &tail) != 3) return NVML_ERROR_INVALID_ARGUMENT;
    }
    nvmlReturn_t rc = NVML_ERROR_NOT_FOUND;
    pthread_mutex_lock(&N.lock);
    if (N.refcount <= 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        for (int i = 0; i < N.cfg.ndev; i++) {
            const sim_device_cfg *d = &N.cfg.dev[i];
            if (d->pci_domain == dom && d->pci_bus == bus && d->pci_device == dev) {
                *device = &N.devs[i];
                rc = NVML_SUCCESS;
            }
        }
    pthread_mutex_unlock(&N.lock);
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    int i;
    sim_device_cfg d;
    nvmlReturn_t rc = sim_nvml_device(device, &i, &d);
    return rc != NVML_SUCCESS ? rc : put_str(name, length, d.name);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    int i;
    sim_device_cfg d;
    nvmlReturn_t rc = sim_nvml_device(device, &i, &d);
    return rc != NVML_SUCCESS ? rc : put_str(uuid, length, d.uuid);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    int i;
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = sim_nvml_device(device, &i, NULL);
    if (rc == NVML_SUCCESS) *index = (unsigned)i;
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    int i;
    sim_device_cfg d;
    if (!minorNumber) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = sim_nvml_device(device, &i, &d);
    if (rc == NVML_SUCCESS) *minorNumber = d.minor;
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    int i;
    sim_device_cfg d;
    if (!node) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = sim_nvml_device(device, &i, &d);
    if (rc != NVML_SUCCESS) return rc;
    if (d.numa_node < 0) return NVML_ERROR_NOT_SUPPORTED; /* configured without a NUMA node */
    *node = (unsigned)d.numa_node;
    return NVML_SUCCESS;
}

/* The brand current drivers report for a product, from its name, as nvidia-smi -q shows them
 * ("Product Brand"): NVIDIA for the data-centre GPUs (A100, H100, L4, and "Tesla T4" too),
 * GeForce for GeForce RTX cards (NVML_BRAND_GEFORCE_RTX is unused), Titan for TITAN RTX,
 * NVIDIA RTX for the RTX workstation cards (RTX A6000). */
static nvmlBrandType_t brand_of(const char *name) {
    if (strstr(name, "GeForce")) return NVML_BRAND_GEFORCE;
    if (strstr(name, "TITAN")) return NVML_BRAND_TITAN;
    if (strstr(name, "Quadro")) return NVML_BRAND_QUADRO;
    if (strncmp(name, "NVIDIA RTX", 10) == 0) return NVML_BRAND_NVIDIA_RTX;
    return NVML_BRAND_NVIDIA;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type) {
    int i;
    sim_device_cfg d;
    if (!type) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = sim_nvml_device(device, &i, &d);
    if (rc == NVML_SUCCESS) *type = brand_of(d.name);
    return rc;
}

static nvmlReturn_t pci_info(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    int i;
    sim_device_cfg d;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = sim_nvml_device(device, &i, &d);
    if (rc != NVML_SUCCESS) return rc;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT, d.pci_domain & 0xffffu,
             d.pci_bus, d.pci_device);
    snprintf(pci->busId, sizeof pci->busId, NVML_DEVICE_PCI_BUS_ID_FMT, d.pci_domain, d.pci_bus, d.pci_device);
    pci->domain = d.pci_domain;
    pci->bus = d.pci_bus;
    pci->device = d.pci_device;
    pci->pciDeviceId = PCI_DEVICE_ID;
    pci->pciSubSystemId = PCI_SUBSYSTEM_ID;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return pci_info(device, pci);
}
SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return pci_info(device, pci);
}
SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) { return pci_info(device, pci); }

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    int i;
    sim_device_cfg d;
    if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = sim_nvml_device(device, &i, &d);
    if (rc == NVML_SUCCESS) {
        *major = d.cc_major;
        *minor = d.cc_minor;
    }
    return rc;
}

/* Memory of the shared device pool (every process's charges, dead processes reaped first).
 * The simulator reserves nothing for the driver: v2's `reserved` is 0 and v1 and v2 agree. */
static nvmlReturn_t mem_info(nvmlDevice_t device, unsigned long long *total, unsigned long long *used) {
    int i;
    sim_device_cfg d;
    nvmlReturn_t rc = sim_nvml_device(device, &i, &d);
    if (rc != NVML_SUCCESS) return rc;
    uint64_t u = sim_mem_used(i, -1);
    sim_obs_set obs; /* the observed states' processes (SIMGPU_OBSERVE) use the same device */
    sim_observe_open(&obs, i, d.memory);
    uint64_t o = sim_observe_used(&obs);
    sim_observe_close(&obs);
    u = u > UINT64_MAX - o ? UINT64_MAX : u + o;
    *total = d.memory;
    *used = u > d.memory ? d.memory : u;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long total, used;
    nvmlReturn_t rc = mem_info(device, &total, &used);
    if (rc == NVML_SUCCESS) {
        memory->total = total;
        memory->used = used;
        memory->free = total - used;
    }
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned long long total, used;
    nvmlReturn_t rc = mem_info(device, &total, &used);
    if (rc == NVML_SUCCESS) {
        memory->total = total;
        memory->reserved = 0;
        memory->used = used;
        memory->free = total - used;
    }
    return rc;
}

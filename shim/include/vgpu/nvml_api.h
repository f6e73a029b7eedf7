/*
 * The NVML API as far as vgpu-sharing uses it: types, constants and prototypes with the exact
 * names, versions, struct layouts and signatures of NVIDIA's nvml.h, so the project builds without
 * the NVML development headers. tests/sim/test_nvml_header.py proves each prototype against a real
 * nvml.h (from the nvidia-nvml-dev wheel) where one can be had: it compiles with
 * -DVGPU_CHECK_AGAINST_NVML_H after #include <nvml.h>, which then supplies the types, so every
 * prototype below must agree with NVIDIA's or the compile fails.
 *
 * Versioned names are declared explicitly (nvmlInit_v2, nvmlDeviceGetHandleByIndex_v2): a binary
 * calls the symbol its header mapped to, and pynvml looks the versioned names up by string. Both
 * the simulator (shim/sim/nvml) and the shim export exactly these.
 */
#ifndef VGPU_NVML_API_H
#define VGPU_NVML_API_H

#ifdef __cplusplus
extern "C" {
#endif

#ifndef VGPU_NVML_API
#define VGPU_NVML_API extern
#endif

#ifndef VGPU_CHECK_AGAINST_NVML_H

#define NVML_API_VERSION_VGPU_DECLARED 13 /* the nvml.h API level these declarations describe */

typedef enum nvmlReturn_enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

/* The product brand (nvmlDeviceGetBrand). */
typedef enum nvmlBrandType_enum {
    NVML_BRAND_UNKNOWN = 0,
    NVML_BRAND_QUADRO = 1,
    NVML_BRAND_TESLA = 2,
    NVML_BRAND_NVS = 3,
    NVML_BRAND_GRID = 4,
    NVML_BRAND_GEFORCE = 5,
    NVML_BRAND_TITAN = 6,
    NVML_BRAND_NVIDIA_VAPPS = 7,
    NVML_BRAND_NVIDIA_VPC = 8,
    NVML_BRAND_NVIDIA_VCS = 9,
    NVML_BRAND_NVIDIA_VWS = 10,
    NVML_BRAND_NVIDIA_CLOUD_GAMING = 11,
    NVML_BRAND_NVIDIA_VGAMING = NVML_BRAND_NVIDIA_CLOUD_GAMING,
    NVML_BRAND_QUADRO_RTX = 12,
    NVML_BRAND_NVIDIA_RTX = 13,
    NVML_BRAND_NVIDIA = 14,
    NVML_BRAND_GEFORCE_RTX = 15, /* unused: GeForce RTX cards report NVML_BRAND_GEFORCE */
    NVML_BRAND_TITAN_RTX = 16,   /* unused */
    NVML_BRAND_NVIDIA_DLA = 17,
    NVML_BRAND_NVIDIA_VGAMEDEV = 18,
    NVML_BRAND_NVIDIA_NPU = 19,
    NVML_BRAND_COUNT = 20
} nvmlBrandType_t;

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;

/* Versioned structs carry (sizeof | version << 24) in their first field. */
#define NVML_STRUCT_VERSION(data, ver) (unsigned int)(sizeof(nvml##data##_v##ver##_t) | (ver << 24U))

#define NVML_VALUE_NOT_AVAILABLE               (-1)
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE     32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE  16
#define NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT      "%04X:%02X:%02X.0"
#define NVML_DEVICE_PCI_BUS_ID_FMT             "%08X:%02X:%02X.0"
#define NVML_DEVICE_UUID_ASCII_LEN             41
#define NVML_DEVICE_UUID_BUFFER_SIZE           80
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE        96
#define NVML_DEVICE_NAME_BUFFER_SIZE           64
#define NVML_DEVICE_NAME_V2_BUFFER_SIZE        96
#define NVML_DEVICE_SERIAL_BUFFER_SIZE         30
#define NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE 80
#define NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE   80
#define NVML_CUDA_DRIVER_VERSION_MAJOR(v)      ((v) / 1000)
#define NVML_CUDA_DRIVER_VERSION_MINOR(v)      (((v) % 1000) / 10)

#define NVML_INIT_FLAG_NO_GPUS   (1 << 0)
#define NVML_INIT_FLAG_NO_ATTACH (1 << 1)

typedef struct nvmlPciInfo_st {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId; /* (device id << 16) | vendor id */
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

typedef struct nvmlUtilization_st {
    unsigned int gpu;    /* % of the last sample period with a kernel executing */
    unsigned int memory; /* % of the last sample period with device memory read or written */
} nvmlUtilization_t;

typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used; /* reserved + allocated */
} nvmlMemory_t;

typedef struct nvmlMemory_v2_st {
    unsigned int version; /* must be nvmlMemory_v2 */
    unsigned long long total;
    unsigned long long reserved; /* for the driver/firmware */
    unsigned long long free;
    unsigned long long used; /* allocated */
} nvmlMemory_v2_t;

#define nvmlMemory_v2 NVML_STRUCT_VERSION(Memory, 2)

typedef struct nvmlProcessInfo_v1_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* nvml.h names the v2 layout nvmlProcessInfo_t; the _v3 functions take it (pynvml: v3_t = v2_t). */
typedef struct nvmlProcessInfo_v2_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;     /* 0xFFFFFFFF without MIG */
    unsigned int computeInstanceId; /* 0xFFFFFFFF without MIG */
} nvmlProcessInfo_v2_t, nvmlProcessInfo_t;

typedef struct nvmlProcessUtilizationSample_st {
    unsigned int pid;
    unsigned long long timeStamp; /* CPU timestamp in microseconds */
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

#define nvmlEventTypeSingleBitEccError 0x0000000000000001LL
#define nvmlEventTypeDoubleBitEccError 0x0000000000000002LL
#define nvmlEventTypePState            0x0000000000000004LL
#define nvmlEventTypeXidCriticalError  0x0000000000000008LL
#define nvmlEventTypeClock             0x0000000000000010LL
#define nvmlEventTypeNone              0x0000000000000000LL

typedef struct nvmlEventData_st {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData; /* the XID for nvmlEventTypeXidCriticalError */
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

#endif /* VGPU_CHECK_AGAINST_NVML_H */

/* ---- prototypes: current (versioned) ABI names ---- */
VGPU_NVML_API nvmlReturn_t nvmlInit_v2(void);
VGPU_NVML_API nvmlReturn_t nvmlInitWithFlags(unsigned int flags);
VGPU_NVML_API nvmlReturn_t nvmlShutdown(void);
VGPU_NVML_API const char *nvmlErrorString(nvmlReturn_t result);
VGPU_NVML_API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length);
VGPU_NVML_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length);
VGPU_NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion);
VGPU_NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                           nvmlProcessUtilizationSample_t *utilization,
                                                           unsigned int *processSamplesCount,
                                                           unsigned long long lastSeenTimeStamp);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                   nvmlProcessInfo_t *infos);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                    nvmlProcessInfo_t *infos);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes);
VGPU_NVML_API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                                    nvmlEventSet_t set);
VGPU_NVML_API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set);
VGPU_NVML_API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms);
VGPU_NVML_API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set);

/* ---- legacy ABI names: still exported by libnvidia-ml.so.1 for binaries built against old
 * headers. nvml.h #defines the unversioned names to their successors unless
 * NVML_NO_UNVERSIONED_FUNC_DEFS is set, so against a real nvml.h they are declared (and checked)
 * only with that macro defined. ---- */
#if !defined(VGPU_CHECK_AGAINST_NVML_H) || defined(NVML_NO_UNVERSIONED_FUNC_DEFS)
VGPU_NVML_API nvmlReturn_t nvmlInit(void);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                                nvmlProcessInfo_v1_t *infos);
VGPU_NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                   nvmlProcessInfo_v2_t *infos);
VGPU_NVML_API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms);
#endif

#ifdef __cplusplus
}
#endif

#endif /* VGPU_NVML_API_H */

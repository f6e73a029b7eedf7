/* Devices: count, identity, memory size, attributes, PCI ids (from the SIMGPU_CONFIG devices). */
#include "init.h"
#include "smlimits.h"

#include "../common/util.h"

#include <stdio.h>
#include <string.h>

SIM_EXPORT CUresult cuDeviceGetCount(int *count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    *count = G.cfg->ndev;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(ordinal);
    if (rc != CUDA_SUCCESS) return rc;
    *device = ordinal;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    sim_copy_str(name, (size_t)len, G.cfg->dev[dev].name);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    memcpy(uuid->bytes, G.cfg->dev[dev].uuid_bytes, 16);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid_v2(uuid, dev); }

SIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    *bytes = G.cfg->dev[dev].memory;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    size_t b;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuDeviceTotalMem_v2(&b, dev);
    if (rc == CUDA_SUCCESS) *bytes = b > 0xffffffffu ? 0xffffffffu : (unsigned int)b; /* the 32-bit ABI saturates */
    return rc;
}

SIM_EXPORT CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev) {
    if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    *major = G.cfg->dev[dev].cc_major;
    *minor = G.cfg->dev[dev].cc_minor;
    return CUDA_SUCCESS;
}

/* What an H100 SXM (CUDA 12/13 driver) answers, with the config's SM count, compute capability,
 * PCI location and NUMA node, and the per-SM limits of its compute capability. The runtime reads
 * every attribute for cudaGetDeviceProperties, and libraries size their kernels from them (cuBLAS
 * refuses to initialise on a device with no registers or opt-in shared memory), so an attribute a
 * real GPU reports is never left at 0. Numbers, not names: vgpu/cuda_api.h declares only the
 * attributes the shim reads. */
static int attribute(const sim_device_cfg *d, int dev, int a) {
    sim_sm_limits sm = sim_sm_limits_of(d->cc_major, d->cc_minor);
    int hopper = d->cc_major >= 9;
    switch (a) {
    case 1: return 1024; /* MAX_THREADS_PER_BLOCK */
    case 2:
    case 3: return 1024;       /* MAX_BLOCK_DIM_X, _Y */
    case 4: return 64;         /* MAX_BLOCK_DIM_Z */
    case 5: return 2147483647; /* MAX_GRID_DIM_X */
    case 6:
    case 7: return 65535;                 /* MAX_GRID_DIM_Y, _Z */
    case 8: return 49152;                 /* MAX_SHARED_MEMORY_PER_BLOCK (without opt-in) */
    case 9: return 65536;                 /* TOTAL_CONSTANT_MEMORY */
    case 10: return 32;                   /* WARP_SIZE */
    case 11: return 2147483647;           /* MAX_PITCH */
    case 12: return sm.regs;              /* MAX_REGISTERS_PER_BLOCK */
    case 13: return 1980000;              /* CLOCK_RATE, kHz */
    case 14: return (int)SIM_ALLOC_ALIGN; /* TEXTURE_ALIGNMENT */
    case 15: return 1;                    /* GPU_OVERLAP */
    case 16: return d->sm_count;          /* MULTIPROCESSOR_COUNT */
    case 17: return 0;                    /* KERNEL_EXEC_TIMEOUT: no display watchdog */
    case 18: return 0;                    /* INTEGRATED */
    case 19: return 1;                    /* CAN_MAP_HOST_MEMORY */
    case 20: return 0;                    /* COMPUTE_MODE: default */
    case 21: return 131072;               /* MAXIMUM_TEXTURE1D_WIDTH */
    case 22: return 131072;               /* MAXIMUM_TEXTURE2D_WIDTH */
    case 23: return 65536;                /* MAXIMUM_TEXTURE2D_HEIGHT */
    case 24:
    case 25:
    case 26: return 16384; /* MAXIMUM_TEXTURE3D_WIDTH, _HEIGHT, _DEPTH */
    case 27:
    case 28: return 32768;              /* MAXIMUM_TEXTURE2D_LAYERED_WIDTH, _HEIGHT */
    case 29: return 2048;               /* MAXIMUM_TEXTURE2D_LAYERED_LAYERS */
    case 30: return 512;                /* SURFACE_ALIGNMENT */
    case 31: return 1;                  /* CONCURRENT_KERNELS */
    case 32: return 1;                  /* ECC_ENABLED (data-centre GPUs ship with ECC on) */
    case 33: return (int)d->pci_bus;    /* PCI_BUS_ID */
    case 34: return (int)d->pci_device; /* PCI_DEVICE_ID */
    case 35: return 0;                  /* TCC_DRIVER (Windows only) */
    case 36: return 2619000;            /* MEMORY_CLOCK_RATE, kHz */
    case 37: return 5120;               /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: return 52428800;           /* L2_CACHE_SIZE */
    case 39: return sm.threads;         /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 40: return 3;                  /* ASYNC_ENGINE_COUNT */
    case 41: return 1;                  /* UNIFIED_ADDRESSING */
    case 42: return 32768;              /* MAXIMUM_TEXTURE1D_LAYERED_WIDTH */
    case 43: return 2048;               /* MAXIMUM_TEXTURE1D_LAYERED_LAYERS */
    case 45:
    case 46: return 32768; /* MAXIMUM_TEXTURE2D_GATHER_WIDTH, _HEIGHT */
    case 47:
    case 48: return 8192;               /* MAXIMUM_TEXTURE3D_WIDTH_ALTERNATE, _HEIGHT_ALTERNATE */
    case 49: return 32768;              /* MAXIMUM_TEXTURE3D_DEPTH_ALTERNATE */
    case 50: return (int)d->pci_domain; /* PCI_DOMAIN_ID */
    case 51: return 32;                 /* TEXTURE_PITCH_ALIGNMENT */
    case 52:
    case 53: return 32768;  /* MAXIMUM_TEXTURECUBEMAP_WIDTH, _LAYERED_WIDTH */
    case 54: return 2046;   /* MAXIMUM_TEXTURECUBEMAP_LAYERED_LAYERS */
    case 55: return 32768;  /* MAXIMUM_SURFACE1D_WIDTH */
    case 56: return 131072; /* MAXIMUM_SURFACE2D_WIDTH */
    case 57: return 65536;  /* MAXIMUM_SURFACE2D_HEIGHT */
    case 58:
    case 59:
    case 60: return 16384; /* MAXIMUM_SURFACE3D_WIDTH, _HEIGHT, _DEPTH */
    case 61: return 32768; /* MAXIMUM_SURFACE1D_LAYERED_WIDTH */
    case 62: return 2048;  /* MAXIMUM_SURFACE1D_LAYERED_LAYERS */
    case 63:
    case 64: return 32768; /* MAXIMUM_SURFACE2D_LAYERED_WIDTH, _HEIGHT */
    case 65: return 2048;  /* MAXIMUM_SURFACE2D_LAYERED_LAYERS */
    case 66:
    case 67: return 32768;     /* MAXIMUM_SURFACECUBEMAP_WIDTH, _LAYERED_WIDTH */
    case 68: return 2046;      /* MAXIMUM_SURFACECUBEMAP_LAYERED_LAYERS */
    case 69: return 268435456; /* MAXIMUM_TEXTURE1D_LINEAR_WIDTH (deprecated) */
    case 70: return 131072;    /* MAXIMUM_TEXTURE2D_LINEAR_WIDTH */
    case 71: return 65000;     /* MAXIMUM_TEXTURE2D_LINEAR_HEIGHT */
    case 72: return 2097120;   /* MAXIMUM_TEXTURE2D_LINEAR_PITCH */
    case 73:
    case 74: return 32768;       /* MAXIMUM_TEXTURE2D_MIPMAPPED_WIDTH, _HEIGHT */
    case 75: return d->cc_major; /* COMPUTE_CAPABILITY_MAJOR */
    case 76: return d->cc_minor; /* COMPUTE_CAPABILITY_MINOR */
    case 77: return 32768;       /* MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH */
    case 78: return 1;           /* STREAM_PRIORITIES_SUPPORTED */
    case 79:
    case 80: return 1;             /* GLOBAL_L1_CACHE_SUPPORTED, LOCAL_L1_CACHE_SUPPORTED */
    case 81: return sm.smem;       /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 82: return sm.regs;       /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    case 83: return 1;             /* MANAGED_MEMORY */
    case 84: return 0;             /* MULTI_GPU_BOARD */
    case 85: return dev;           /* MULTI_GPU_BOARD_GROUP_ID */
    case 86: return 0;             /* HOST_NATIVE_ATOMIC_SUPPORTED (PCIe, no NVLink-C2C) */
    case 87: return 2;             /* SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO */
    case 88: return 0;             /* PAGEABLE_MEMORY_ACCESS (no HMM) */
    case 89: return 1;             /* CONCURRENT_MANAGED_ACCESS */
    case 90: return 1;             /* COMPUTE_PREEMPTION_SUPPORTED */
    case 91: return 1;             /* CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM */
    case 95: return 1;             /* COOPERATIVE_LAUNCH */
    case 96: return 1;             /* COOPERATIVE_MULTI_DEVICE_LAUNCH (deprecated) */
    case 97: return sm.smem_optin; /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    case 98: return 0;             /* CAN_FLUSH_REMOTE_WRITES */
    case 99: return 1;             /* HOST_REGISTER_SUPPORTED */
    case 100:
    case 101: return 0; /* PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES, DIRECT_MANAGED_MEM_ACCESS_FROM_HOST */
    case 102: return 1; /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: return 1; /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    case 104:
    case 105: return 0;                /* HANDLE_TYPE_WIN32_HANDLE_SUPPORTED, _WIN32_KMT_ */
    case 106: return sm.blocks;        /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    case 107: return 1;                /* GENERIC_COMPRESSION_SUPPORTED */
    case 108: return 32505856;         /* MAX_PERSISTING_L2_CACHE_SIZE */
    case 109: return 134213632;        /* MAX_ACCESS_POLICY_WINDOW_SIZE */
    case 111: return sm.smem_reserved; /* RESERVED_SHARED_MEMORY_PER_BLOCK */
    case 112: return 1;                /* SPARSE_CUDA_ARRAY_SUPPORTED */
    case 113: return 1;                /* READ_ONLY_HOST_REGISTER_SUPPORTED */
    case 114: return 1;                /* TIMELINE_SEMAPHORE_INTEROP_SUPPORTED */
    case 115: return 1;                /* MEMORY_POOLS_SUPPORTED */
    case 119: return 1;                /* MEMPOOL_SUPPORTED_HANDLE_TYPES: POSIX file descriptor */
    case 120: return hopper;           /* CLUSTER_LAUNCH */
    case 121: return 1;                /* DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED */
    case 125: return 1;                /* IPC_EVENT_SUPPORTED */
    case 126: return hopper ? 4 : 1;   /* MEM_SYNC_DOMAIN_COUNT */
    case 127: return hopper;           /* TENSOR_MAP_ACCESS_SUPPORTED */
    case 129: return 1;                /* UNIFIED_FUNCTION_POINTERS */
    case 131: return -1;               /* NUMA_ID: device memory is no NUMA node */
    case 134: return d->numa_node;     /* HOST_NUMA_ID */
    case 139: return (int)0x233010DE;  /* GPU_PCI_DEVICE_ID: H100 SXM5 (0x2330) by NVIDIA (0x10DE), as NVML says */
    case 140: return (int)0x16C110DE;  /* GPU_PCI_SUBSYSTEM_ID, as NVML says */
    default:
        return 0; /* GPUDirect RDMA, multicast, MPS, fabric handles, stream wait value,
                          decompression: a capability the simulator does not model */
    }
}

SIM_EXPORT CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    if ((int)attrib <= 0 || (int)attrib >= (int)CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
    *pi = attribute(&G.cfg->dev[dev], dev, (int)attrib);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
    if (!pciBusId || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    char buf[32];
    const sim_device_cfg *d = &G.cfg->dev[dev];
    snprintf(buf, sizeof buf, "%04X:%02X:%02X.0", d->pci_domain, d->pci_bus, d->pci_device);
    sim_copy_str(pciBusId, (size_t)len, buf);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId) {
    if (!dev || !pciBusId) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    unsigned dom = 0, bus, device, fn;
    char tail;
    if (sscanf(pciBusId, "%x:%x:%x.%x%c", &dom, &bus, &device, &fn, &tail) != 4) {
        dom = 0;
        if (sscanf(pciBusId, "%x:%x.%x%c", &bus, &device, &fn, &tail) != 3) return CUDA_ERROR_INVALID_VALUE;
    }
    for (int i = 0; i < G.cfg->ndev; i++) {
        const sim_device_cfg *d = &G.cfg->dev[i];
        if (d->pci_domain == dom && d->pci_bus == bus && d->pci_device == device) {
            *dev = i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

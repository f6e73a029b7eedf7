/*
 * The CUDA driver API as far as vgpu-sharing uses it: types, constants and prototypes with the
 * exact names, versions and signatures of NVIDIA's cuda.h, so the project builds without a CUDA
 * toolkit. tests/shim/test_cuda_header.py proves each prototype against NVIDIA's cuda.h (CUDA 12 and 13, pinned wheels)
 * (compiled with -DVGPU_CHECK_AGAINST_CUDA_H after #include <cuda.h>, which then supplies the types).
 *
 * Versioned names are declared explicitly (cuMemAlloc_v2, cuLaunchKernel_ptsz): a binary calls the
 * symbol its header mapped to, and both the simulator and the shim must export exactly those.
 */
#ifndef VGPU_CUDA_API_H
#define VGPU_CUDA_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef VGPU_CUDA_API
#define VGPU_CUDA_API extern
#endif

#ifndef VGPU_CHECK_AGAINST_CUDA_H

#define CUDA_VERSION_VGPU_DECLARED 12080 /* the API level these declarations describe */

typedef uint32_t cuuint32_t;
typedef uint64_t cuuint64_t;
typedef unsigned long long CUdeviceptr_v2;
typedef CUdeviceptr_v2 CUdeviceptr;
typedef unsigned int CUdeviceptr_v1;
typedef int CUdevice_v1;
typedef CUdevice_v1 CUdevice;
typedef unsigned long long CUmemGenericAllocationHandle_v1;
typedef CUmemGenericAllocationHandle_v1 CUmemGenericAllocationHandle;

typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;

typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

#define CU_STREAM_LEGACY               ((CUstream)0x1)
#define CU_STREAM_PER_THREAD           ((CUstream)0x2)
#define CU_STREAM_DEFAULT              0x0
#define CU_STREAM_NON_BLOCKING         0x1
#define CU_EVENT_DEFAULT               0x0
#define CU_EVENT_BLOCKING_SYNC         0x1
#define CU_EVENT_DISABLE_TIMING        0x2
#define CU_MEM_ATTACH_GLOBAL           0x1
#define CU_MEM_ATTACH_HOST             0x2
#define CU_CTX_SCHED_AUTO              0x0
#define CUDA_ARRAY3D_LAYERED           0x01
#define CUDA_ARRAY3D_SURFACE_LDST      0x02
#define CUDA_ARRAY3D_CUBEMAP           0x04
#define CUDA_ARRAY3D_DEFERRED_MAPPING  0x80
#define CU_LAUNCH_PARAM_END            ((void *)0x00)
#define CU_LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define CU_LAUNCH_PARAM_BUFFER_SIZE    ((void *)0x02)

typedef enum cudaError_enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_STUB_LIBRARY = 34,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_CONTEXT_ALREADY_CURRENT = 202,
    CUDA_ERROR_MAP_FAILED = 205,
    CUDA_ERROR_UNMAP_FAILED = 206,
    CUDA_ERROR_ALREADY_MAPPED = 208,
    CUDA_ERROR_NOT_MAPPED = 211,
    CUDA_ERROR_UNSUPPORTED_LIMIT = 215,
    CUDA_ERROR_INVALID_SOURCE = 300,
    CUDA_ERROR_FILE_NOT_FOUND = 301,
    CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND = 302,
    CUDA_ERROR_SHARED_OBJECT_INIT_FAILED = 303,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903,
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
    CUDA_ERROR_UNKNOWN = 999
} CUresult;

typedef enum CUdevice_attribute_enum {
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y = 3,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z = 4,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y = 6,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z = 7,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8,
    CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY = 9,
    CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10,
    CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13,
    CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT = 14,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_INTEGRATED = 18,
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
    CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
    CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36,
    CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37,
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38,
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39,
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
    CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT = 51,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 83,
    CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 89,
    CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95,
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115,
    CU_DEVICE_ATTRIBUTE_MAX = 148
} CUdevice_attribute;

typedef enum CUarray_format_enum {
    CU_AD_FORMAT_UNSIGNED_INT8 = 0x01,
    CU_AD_FORMAT_UNSIGNED_INT16 = 0x02,
    CU_AD_FORMAT_UNSIGNED_INT32 = 0x03,
    CU_AD_FORMAT_SIGNED_INT8 = 0x08,
    CU_AD_FORMAT_SIGNED_INT16 = 0x09,
    CU_AD_FORMAT_SIGNED_INT32 = 0x0a,
    CU_AD_FORMAT_HALF = 0x10,
    CU_AD_FORMAT_FLOAT = 0x20
} CUarray_format;

typedef struct CUDA_ARRAY_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR_v2;
typedef CUDA_ARRAY_DESCRIPTOR_v2 CUDA_ARRAY_DESCRIPTOR;

typedef struct CUDA_ARRAY3D_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    size_t Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR_v2;
typedef CUDA_ARRAY3D_DESCRIPTOR_v2 CUDA_ARRAY3D_DESCRIPTOR;
typedef struct CUDA_ARRAY_MEMORY_REQUIREMENTS_st {
    size_t size;
    size_t alignment;
    unsigned int reserved[4];
} CUDA_ARRAY_MEMORY_REQUIREMENTS_v1;
typedef CUDA_ARRAY_MEMORY_REQUIREMENTS_v1 CUDA_ARRAY_MEMORY_REQUIREMENTS;

typedef enum CUmemAllocationType_enum {
    CU_MEM_ALLOCATION_TYPE_INVALID = 0x0,
    CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
    CU_MEM_ALLOCATION_TYPE_MAX = 0x7FFFFFFF
} CUmemAllocationType;

typedef enum CUmemAllocationHandleType_enum {
    CU_MEM_HANDLE_TYPE_NONE = 0x0,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
    CU_MEM_HANDLE_TYPE_MAX = 0x7FFFFFFF
} CUmemAllocationHandleType;

typedef enum CUmemLocationType_enum {
    CU_MEM_LOCATION_TYPE_INVALID = 0x0,
    CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
    CU_MEM_LOCATION_TYPE_HOST = 0x2,
    CU_MEM_LOCATION_TYPE_HOST_NUMA = 0x3,
    CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 0x4,
    CU_MEM_LOCATION_TYPE_MAX = 0x7FFFFFFF
} CUmemLocationType;

typedef enum CUmemAccess_flags_enum {
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0,
    CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
    CU_MEM_ACCESS_FLAGS_PROT_MAX = 0x7FFFFFFF
} CUmemAccess_flags;

typedef enum CUmemAllocationGranularity_flags_enum {
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
} CUmemAllocationGranularity_flags;

typedef struct CUmemLocation_st {
    CUmemLocationType type;
    int id;
} CUmemLocation_v1;
typedef CUmemLocation_v1 CUmemLocation;

typedef struct CUmemAllocationProp_st {
    CUmemAllocationType type;
    CUmemAllocationHandleType requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp_v1;
typedef CUmemAllocationProp_v1 CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    CUmemAccess_flags flags;
} CUmemAccessDesc_v1;
typedef CUmemAccessDesc_v1 CUmemAccessDesc;

typedef struct CUmemPoolProps_st {
    CUmemAllocationType allocType;
    CUmemAllocationHandleType handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps_v1;
typedef CUmemPoolProps_v1 CUmemPoolProps;

typedef enum CUmemPool_attribute_enum {
    CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1,
    CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC = 2,
    CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3,
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5,
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6,
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7,
    CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8
} CUmemPool_attribute;

typedef struct CUuserObject_st *CUuserObject;
typedef enum CUuserObject_flags_enum { CU_USER_OBJECT_NO_DESTRUCTOR_SYNC = 1 } CUuserObject_flags;
typedef enum CUuserObjectRetain_flags_enum { CU_GRAPH_USER_OBJECT_MOVE = 1 } CUuserObjectRetain_flags;

typedef struct CUDA_MEM_ALLOC_NODE_PARAMS_v1_st {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS_v1;
typedef CUDA_MEM_ALLOC_NODE_PARAMS_v1 CUDA_MEM_ALLOC_NODE_PARAMS;

typedef enum CUgraphMem_attribute_enum {
    CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT,
    CU_GRAPH_MEM_ATTR_USED_MEM_HIGH,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH
} CUgraphMem_attribute;

typedef enum CUgraphNodeType_enum {
    CU_GRAPH_NODE_TYPE_KERNEL = 0,
    CU_GRAPH_NODE_TYPE_MEMCPY = 1,
    CU_GRAPH_NODE_TYPE_MEMSET = 2,
    CU_GRAPH_NODE_TYPE_HOST = 3,
    CU_GRAPH_NODE_TYPE_GRAPH = 4,
    CU_GRAPH_NODE_TYPE_EMPTY = 5,
    CU_GRAPH_NODE_TYPE_WAIT_EVENT = 6,
    CU_GRAPH_NODE_TYPE_EVENT_RECORD = 7,
    CU_GRAPH_NODE_TYPE_EXT_SEMAS_SIGNAL = 8,
    CU_GRAPH_NODE_TYPE_EXT_SEMAS_WAIT = 9,
    CU_GRAPH_NODE_TYPE_MEM_ALLOC = 10,
    CU_GRAPH_NODE_TYPE_MEM_FREE = 11,
    CU_GRAPH_NODE_TYPE_BATCH_MEM_OP = 12,
    CU_GRAPH_NODE_TYPE_CONDITIONAL = 13
} CUgraphNodeType;

typedef enum CUgraphInstantiate_flags_enum {
    CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH = 1,
    CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD = 2,
    CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH = 4,
    CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY = 8
} CUgraphInstantiate_flags;

typedef enum CUgraphInstantiateResult_enum {
    CUDA_GRAPH_INSTANTIATE_SUCCESS = 0,
    CUDA_GRAPH_INSTANTIATE_ERROR = 1,
    CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE = 2,
    CUDA_GRAPH_INSTANTIATE_NODE_OPERATION_NOT_SUPPORTED = 3,
    CUDA_GRAPH_INSTANTIATE_MULTIPLE_CTXS_NOT_SUPPORTED = 4,
    CUDA_GRAPH_INSTANTIATE_CONDITIONAL_HANDLE_UNUSED = 5
} CUgraphInstantiateResult;

typedef struct CUDA_GRAPH_INSTANTIATE_PARAMS_st {
    cuuint64_t flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    CUgraphInstantiateResult result_out;
} CUDA_GRAPH_INSTANTIATE_PARAMS;

typedef struct CUgraphEdgeData_st {
    unsigned char from_port;
    unsigned char to_port;
    unsigned char type;
    unsigned char reserved[5];
} CUgraphEdgeData;

typedef enum CUstreamCaptureStatus_enum {
    CU_STREAM_CAPTURE_STATUS_NONE = 0,
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2
} CUstreamCaptureStatus;

typedef enum CUstreamCaptureMode_enum {
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
    CU_STREAM_CAPTURE_MODE_RELAXED = 2
} CUstreamCaptureMode;

typedef enum CUjit_option_enum { CU_JIT_MAX_REGISTERS = 0 } CUjit_option;
typedef enum CUlibraryOption_enum { CU_LIBRARY_HOST_UNIVERSAL_FUNCTION_AND_DATA_TABLE = 0 } CUlibraryOption;

typedef enum CUlaunchAttributeID_enum {
    CU_LAUNCH_ATTRIBUTE_IGNORE = 0,
    CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1,
    CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2,
    CU_LAUNCH_ATTRIBUTE_PRIORITY = 8
} CUlaunchAttributeID;

typedef union CUlaunchAttributeValue_union {
    char pad[64];
    int cooperative;
    int priority;
    struct {
        unsigned int x;
        unsigned int y;
        unsigned int z;
    } clusterDim;
} CUlaunchAttributeValue;

typedef struct CUlaunchAttribute_st {
    CUlaunchAttributeID id;
    char pad[8 - sizeof(CUlaunchAttributeID)];
    CUlaunchAttributeValue value;
} CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
    unsigned int gridDimX;
    unsigned int gridDimY;
    unsigned int gridDimZ;
    unsigned int blockDimX;
    unsigned int blockDimY;
    unsigned int blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig_v1;
typedef CUlaunchConfig_v1 CUlaunchConfig;

typedef enum CUexecAffinityType_enum { CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0 } CUexecAffinityType;
typedef struct CUexecAffinityParam_st {
    CUexecAffinityType type;
    union {
        struct {
            unsigned int val;
        } smCount;
    } param;
} CUexecAffinityParam_v1;
typedef CUexecAffinityParam_v1 CUexecAffinityParam;
typedef struct CUctxCigParam_st CUctxCigParam;
typedef struct CUctxCreateParams_st {
    CUexecAffinityParam *execAffinityParams;
    int numExecAffinityParams;
    CUctxCigParam *cigParams;
} CUctxCreateParams;

typedef enum CUdriverProcAddress_flags_enum {
    CU_GET_PROC_ADDRESS_DEFAULT = 0,
    CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1 << 0,
    CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 1 << 1
} CUdriverProcAddress_flags;

typedef enum CUdriverProcAddressQueryResult_enum {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
} CUdriverProcAddressQueryResult;

typedef enum CUpointer_attribute_enum {
    CU_POINTER_ATTRIBUTE_CONTEXT = 1,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,
    CU_POINTER_ATTRIBUTE_HOST_POINTER = 4,
    CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
} CUpointer_attribute;

/* Legacy (CUDA < 3.2) array descriptors with 32-bit sizes, for cuArrayCreate / cuArray3DCreate. */
typedef struct CUDA_ARRAY_DESCRIPTOR_v1_st {
    unsigned int Width;
    unsigned int Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR_v1;

typedef struct CUDA_ARRAY3D_DESCRIPTOR_v1_st {
    unsigned int Width;
    unsigned int Height;
    unsigned int Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR_v1;

/* Kernel attributes, occupancy, host memory, stream callbacks, linker, IPC, 2D/3D copies: the
 * surface real clients (numba-cuda, cuda.core, CuPy-style programs) call in ordinary use. */
typedef enum CUfunction_attribute_enum {
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0,
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1,
    CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES = 2,
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3,
    CU_FUNC_ATTRIBUTE_NUM_REGS = 4,
    CU_FUNC_ATTRIBUTE_PTX_VERSION = 5,
    CU_FUNC_ATTRIBUTE_BINARY_VERSION = 6,
    CU_FUNC_ATTRIBUTE_CACHE_MODE_CA = 7,
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
    CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9,
    CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET = 10,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH = 11,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT = 12,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH = 13,
    CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14,
    CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 15,
    CU_FUNC_ATTRIBUTE_MAX
} CUfunction_attribute;

typedef enum CUfunc_cache_enum {
    CU_FUNC_CACHE_PREFER_NONE = 0x00,
    CU_FUNC_CACHE_PREFER_SHARED = 0x01,
    CU_FUNC_CACHE_PREFER_L1 = 0x02,
    CU_FUNC_CACHE_PREFER_EQUAL = 0x03
} CUfunc_cache;

typedef enum CUlimit_enum {
    CU_LIMIT_STACK_SIZE = 0x00,
    CU_LIMIT_PRINTF_FIFO_SIZE = 0x01,
    CU_LIMIT_MALLOC_HEAP_SIZE = 0x02,
    CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH = 0x03,
    CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT = 0x04,
    CU_LIMIT_MAX_L2_FETCH_GRANULARITY = 0x05,
    CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06,
    CU_LIMIT_SHMEM_SIZE = 0x07,
    CU_LIMIT_CIG_ENABLED = 0x08,
    CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED = 0x09,
    CU_LIMIT_MAX
} CUlimit;

typedef enum CUjitInputType_enum {
    CU_JIT_INPUT_CUBIN = 0,
    CU_JIT_INPUT_PTX = 1,
    CU_JIT_INPUT_FATBINARY = 2,
    CU_JIT_INPUT_OBJECT = 3,
    CU_JIT_INPUT_LIBRARY = 4,
    CU_JIT_INPUT_NVVM = 5,
    CU_JIT_NUM_INPUT_TYPES = 6
} CUjitInputType;
typedef struct CUlinkState_st *CUlinkState;

typedef size_t (*CUoccupancyB2DSize)(int blockSize);
typedef void (*CUstreamCallback)(CUstream hStream, CUresult status, void *userData);
typedef void (*CUhostFn)(void *userData);

#define CU_MEMHOSTALLOC_PORTABLE         0x01
#define CU_MEMHOSTALLOC_DEVICEMAP        0x02
#define CU_MEMHOSTALLOC_WRITECOMBINED    0x04
#define CU_MEMHOSTREGISTER_PORTABLE      0x01
#define CU_MEMHOSTREGISTER_DEVICEMAP     0x02
#define CU_MEMHOSTREGISTER_IOMEMORY      0x04
#define CU_MEMHOSTREGISTER_READ_ONLY     0x08
#define CU_STREAM_CALLBACK_FLAGS_DEFAULT 0 /* (not a cuda.h name: the only allowed flags value is 0) */

#define CU_IPC_HANDLE_SIZE 64
typedef struct CUipcMemHandle_st {
    char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle_v1;
typedef CUipcMemHandle_v1 CUipcMemHandle;
typedef struct CUipcEventHandle_st {
    char reserved[CU_IPC_HANDLE_SIZE];
} CUipcEventHandle_v1;
typedef CUipcEventHandle_v1 CUipcEventHandle;

typedef enum CUmemorytype_enum {
    CU_MEMORYTYPE_HOST = 0x01,
    CU_MEMORYTYPE_DEVICE = 0x02,
    CU_MEMORYTYPE_ARRAY = 0x03,
    CU_MEMORYTYPE_UNIFIED = 0x04
} CUmemorytype;

typedef struct CUDA_MEMCPY2D_st {
    size_t srcXInBytes;
    size_t srcY;
    CUmemorytype srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    CUarray srcArray;
    size_t srcPitch;
    size_t dstXInBytes;
    size_t dstY;
    CUmemorytype dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    CUarray dstArray;
    size_t dstPitch;
    size_t WidthInBytes;
    size_t Height;
} CUDA_MEMCPY2D_v2;
typedef CUDA_MEMCPY2D_v2 CUDA_MEMCPY2D;

typedef struct CUDA_MEMCPY3D_st {
    size_t srcXInBytes;
    size_t srcY;
    size_t srcZ;
    size_t srcLOD;
    CUmemorytype srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    CUarray srcArray;
    void *reserved0;
    size_t srcPitch;
    size_t srcHeight;
    size_t dstXInBytes;
    size_t dstY;
    size_t dstZ;
    size_t dstLOD;
    CUmemorytype dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    CUarray dstArray;
    void *reserved1;
    size_t dstPitch;
    size_t dstHeight;
    size_t WidthInBytes;
    size_t Height;
    size_t Depth;
} CUDA_MEMCPY3D_v2;
typedef CUDA_MEMCPY3D_v2 CUDA_MEMCPY3D;

#endif /* VGPU_CHECK_AGAINST_CUDA_H */

/* ---- prototypes: current (versioned) ABI names ---- */
VGPU_CUDA_API CUresult cuInit(unsigned int Flags);
VGPU_CUDA_API CUresult cuDriverGetVersion(int *driverVersion);
VGPU_CUDA_API CUresult cuDeviceGet(CUdevice *device, int ordinal);
VGPU_CUDA_API CUresult cuDeviceGetCount(int *count);
VGPU_CUDA_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
VGPU_CUDA_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
VGPU_CUDA_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
VGPU_CUDA_API CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);
VGPU_CUDA_API CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev);
VGPU_CUDA_API CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId);
VGPU_CUDA_API CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev);
VGPU_CUDA_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
VGPU_CUDA_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
VGPU_CUDA_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);
VGPU_CUDA_API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active);
VGPU_CUDA_API CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags);
VGPU_CUDA_API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                      CUdevice dev);
VGPU_CUDA_API CUresult cuCtxDestroy_v2(CUcontext ctx);
VGPU_CUDA_API CUresult cuCtxGetCurrent(CUcontext *pctx);
VGPU_CUDA_API CUresult cuCtxSetCurrent(CUcontext ctx);
VGPU_CUDA_API CUresult cuCtxPushCurrent_v2(CUcontext ctx);
VGPU_CUDA_API CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
VGPU_CUDA_API CUresult cuCtxGetDevice(CUdevice *device);
VGPU_CUDA_API CUresult cuCtxSynchronize(void);
VGPU_CUDA_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
VGPU_CUDA_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                          unsigned int ElementSizeBytes);
VGPU_CUDA_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
VGPU_CUDA_API CUresult cuMemFree_v2(CUdeviceptr dptr);
VGPU_CUDA_API CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
VGPU_CUDA_API CUresult cuMemAllocHost_v2(void **pp, size_t bytesize);
VGPU_CUDA_API CUresult cuMemFreeHost(void *p);
VGPU_CUDA_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
VGPU_CUDA_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
VGPU_CUDA_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
VGPU_CUDA_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
VGPU_CUDA_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps);
VGPU_CUDA_API CUresult cuMemPoolDestroy(CUmemoryPool pool);
VGPU_CUDA_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream);
VGPU_CUDA_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                    CUstream hStream);
VGPU_CUDA_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev);
VGPU_CUDA_API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
VGPU_CUDA_API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);
VGPU_CUDA_API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value);
VGPU_CUDA_API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value);
VGPU_CUDA_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                   unsigned long long flags);
VGPU_CUDA_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
VGPU_CUDA_API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
VGPU_CUDA_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                      CUmemAllocationHandleType shHandleType);
VGPU_CUDA_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                           unsigned long long flags);
VGPU_CUDA_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
VGPU_CUDA_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                                unsigned long long flags);
VGPU_CUDA_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
VGPU_CUDA_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
VGPU_CUDA_API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                     CUmemAllocationGranularity_flags option);
VGPU_CUDA_API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray);
VGPU_CUDA_API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray);
VGPU_CUDA_API CUresult cuArrayDestroy(CUarray hArray);
VGPU_CUDA_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                              const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                              unsigned int numMipmapLevels);
VGPU_CUDA_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray);
VGPU_CUDA_API CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *memoryRequirements, CUarray array,
                                                    CUdevice device);
VGPU_CUDA_API CUresult cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *memoryRequirements,
                                                             CUmipmappedArray mipmap, CUdevice device);
VGPU_CUDA_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
VGPU_CUDA_API CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
VGPU_CUDA_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
VGPU_CUDA_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                            CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                            CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
VGPU_CUDA_API CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
VGPU_CUDA_API CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
VGPU_CUDA_API CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                                 CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                                 CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                                 CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount);
VGPU_CUDA_API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
VGPU_CUDA_API CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);
VGPU_CUDA_API CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N);
VGPU_CUDA_API CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);
VGPU_CUDA_API CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream);
VGPU_CUDA_API CUresult cuModuleLoadData(CUmodule *module, const void *image);
VGPU_CUDA_API CUresult cuModuleLoad(CUmodule *module, const char *fname);
VGPU_CUDA_API CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                          CUjit_option *options, void **optionValues);
VGPU_CUDA_API CUresult cuModuleUnload(CUmodule hmod);
VGPU_CUDA_API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
VGPU_CUDA_API CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                         void **jitOptionsValues, unsigned int numJitOptions,
                                         CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                         unsigned int numLibraryOptions);
VGPU_CUDA_API CUresult cuLibraryUnload(CUlibrary library);
VGPU_CUDA_API CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name);
VGPU_CUDA_API CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                             void **jitOptionsValues, unsigned int numJitOptions,
                                             CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                             unsigned int numLibraryOptions);
VGPU_CUDA_API CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin);
VGPU_CUDA_API CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name);
VGPU_CUDA_API CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel);
VGPU_CUDA_API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                      unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                      unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra);
VGPU_CUDA_API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                           unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                           unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                           void **kernelParams, void **extra);
VGPU_CUDA_API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra);
VGPU_CUDA_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                             void **extra);
VGPU_CUDA_API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                 unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                                 unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                                 void **kernelParams);
VGPU_CUDA_API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                      unsigned int gridDimZ, unsigned int blockDimX,
                                                      unsigned int blockDimY, unsigned int blockDimZ,
                                                      unsigned int sharedMemBytes, CUstream hStream,
                                                      void **kernelParams);
VGPU_CUDA_API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
VGPU_CUDA_API CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority);
VGPU_CUDA_API CUresult cuStreamDestroy_v2(CUstream hStream);
VGPU_CUDA_API CUresult cuStreamSynchronize(CUstream hStream);
VGPU_CUDA_API CUresult cuStreamSynchronize_ptsz(CUstream hStream);
VGPU_CUDA_API CUresult cuStreamQuery(CUstream hStream);
VGPU_CUDA_API CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode);
VGPU_CUDA_API CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode);
VGPU_CUDA_API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
VGPU_CUDA_API CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph);
VGPU_CUDA_API CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus);
VGPU_CUDA_API CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags);
VGPU_CUDA_API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
VGPU_CUDA_API CUresult cuEventDestroy_v2(CUevent hEvent);
VGPU_CUDA_API CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
VGPU_CUDA_API CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream);
VGPU_CUDA_API CUresult cuEventSynchronize(CUevent hEvent);
VGPU_CUDA_API CUresult cuEventQuery(CUevent hEvent);
VGPU_CUDA_API CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd);
VGPU_CUDA_API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags);
VGPU_CUDA_API CUresult cuGraphDestroy(CUgraph hGraph);
VGPU_CUDA_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags);
VGPU_CUDA_API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
VGPU_CUDA_API CUresult cuGraphLaunch(CUgraphExec hGraph, CUstream hStream);
VGPU_CUDA_API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream);
VGPU_CUDA_API CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes);
VGPU_CUDA_API CUresult cuGraphNodeGetType(CUgraphNode hNode, CUgraphNodeType *type);
VGPU_CUDA_API CUresult cuGraphExecGetFlags(CUgraphExec hGraphExec, cuuint64_t *flags);
VGPU_CUDA_API CUresult cuUserObjectCreate(CUuserObject *object_out, void *ptr, CUhostFn destroy,
                                          unsigned int initialRefcount, unsigned int flags);
VGPU_CUDA_API CUresult cuUserObjectRetain(CUuserObject object, unsigned int count);
VGPU_CUDA_API CUresult cuUserObjectRelease(CUuserObject object, unsigned int count);
VGPU_CUDA_API CUresult cuGraphRetainUserObject(CUgraph graph, CUuserObject object, unsigned int count,
                                               unsigned int flags);
VGPU_CUDA_API CUresult cuGraphReleaseUserObject(CUgraph graph, CUuserObject object, unsigned int count);
VGPU_CUDA_API CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                    CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams);
VGPU_CUDA_API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                         CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams);
VGPU_CUDA_API CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                 cuuint64_t *id_out, CUgraph *graph_out,
                                                 const CUgraphNode **dependencies_out, size_t *numDependencies_out);
VGPU_CUDA_API CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                      cuuint64_t *id_out, CUgraph *graph_out,
                                                      const CUgraphNode **dependencies_out,
                                                      size_t *numDependencies_out);
VGPU_CUDA_API CUresult cuStreamGetCaptureInfo_v3(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                 cuuint64_t *id_out, CUgraph *graph_out,
                                                 const CUgraphNode **dependencies_out,
                                                 const CUgraphEdgeData **edgeData_out, size_t *numDependencies_out);
VGPU_CUDA_API CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                                      cuuint64_t *id_out, CUgraph *graph_out,
                                                      const CUgraphNode **dependencies_out,
                                                      const CUgraphEdgeData **edgeData_out,
                                                      size_t *numDependencies_out);
VGPU_CUDA_API CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                              size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams);
VGPU_CUDA_API CUresult cuGraphMemAllocNodeGetParams(CUgraphNode hNode, CUDA_MEM_ALLOC_NODE_PARAMS *params_out);
VGPU_CUDA_API CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                             size_t numDependencies, CUdeviceptr dptr);
VGPU_CUDA_API CUresult cuGraphMemFreeNodeGetParams(CUgraphNode hNode, CUdeviceptr *dptr_out);
VGPU_CUDA_API CUresult cuDeviceGraphMemTrim(CUdevice device);
VGPU_CUDA_API CUresult cuDeviceGetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value);
VGPU_CUDA_API CUresult cuDeviceSetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value);
VGPU_CUDA_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                           CUdriverProcAddressQueryResult *symbolStatus);
VGPU_CUDA_API CUresult cuGetErrorString(CUresult error, const char **pStr);
VGPU_CUDA_API CUresult cuGetErrorName(CUresult error, const char **pStr);
VGPU_CUDA_API CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId);
VGPU_CUDA_API CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr);
VGPU_CUDA_API CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr);

/* Added with the simulator: the remaining per-thread-default-stream variants and the CUDA 13
 * context-explicit forms, so cuda_procaddr.def can name a real symbol for every (name, version). */
VGPU_CUDA_API CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx);
VGPU_CUDA_API CUresult cuCtxSynchronize_v2(CUcontext ctx);
VGPU_CUDA_API CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount);
VGPU_CUDA_API CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
VGPU_CUDA_API CUresult cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N);
VGPU_CUDA_API CUresult cuMemsetD32_v2_ptds(CUdeviceptr dstDevice, unsigned int ui, size_t N);
VGPU_CUDA_API CUresult cuMemsetD8Async_ptsz(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);
VGPU_CUDA_API CUresult cuMemsetD32Async_ptsz(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream);
VGPU_CUDA_API CUresult cuStreamQuery_ptsz(CUstream hStream);
VGPU_CUDA_API CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags);
VGPU_CUDA_API CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus);

/* Added for real clients (numba-cuda, cuda.core): attributes, occupancy, host memory, stream
 * priorities and callbacks, module globals, 2D/3D copies, the linker, IPC, context limits. */
VGPU_CUDA_API CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc);
VGPU_CUDA_API CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value);
VGPU_CUDA_API CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config);
VGPU_CUDA_API CUresult cuFuncGetModule(CUmodule *hmod, CUfunction hfunc);
VGPU_CUDA_API CUresult cuFuncGetName(const char **name, CUfunction hfunc);
VGPU_CUDA_API CUresult cuKernelGetAttribute(int *pi, CUfunction_attribute attrib, CUkernel kernel, CUdevice dev);
VGPU_CUDA_API CUresult cuKernelSetAttribute(CUfunction_attribute attrib, int val, CUkernel kernel, CUdevice dev);
VGPU_CUDA_API CUresult cuKernelSetCacheConfig(CUkernel kernel, CUfunc_cache config, CUdevice dev);
VGPU_CUDA_API CUresult cuKernelGetName(const char **name, CUkernel hfunc);
VGPU_CUDA_API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func, int blockSize,
                                                                   size_t dynamicSMemSize);
VGPU_CUDA_API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *numBlocks, CUfunction func,
                                                                            int blockSize, size_t dynamicSMemSize,
                                                                            unsigned int flags);
VGPU_CUDA_API CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                                        CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                        size_t dynamicSMemSize, int blockSizeLimit);
VGPU_CUDA_API CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *minGridSize, int *blockSize, CUfunction func,
                                                                 CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                                 size_t dynamicSMemSize, int blockSizeLimit,
                                                                 unsigned int flags);
VGPU_CUDA_API CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *dynamicSmemSize, CUfunction func, int numBlocks,
                                                               int blockSize);
VGPU_CUDA_API CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags);
VGPU_CUDA_API CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags);
VGPU_CUDA_API CUresult cuMemHostUnregister(void *p);
VGPU_CUDA_API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags);
VGPU_CUDA_API CUresult cuMemHostGetFlags(unsigned int *pFlags, void *p);
VGPU_CUDA_API CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority);
VGPU_CUDA_API CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit);
VGPU_CUDA_API CUresult cuCtxSetLimit(CUlimit limit, size_t value);
VGPU_CUDA_API CUresult cuCtxGetCacheConfig(CUfunc_cache *pconfig);
VGPU_CUDA_API CUresult cuCtxSetCacheConfig(CUfunc_cache config);
VGPU_CUDA_API CUresult cuCtxGetFlags(unsigned int *flags);
VGPU_CUDA_API CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version);
VGPU_CUDA_API CUresult cuStreamGetPriority(CUstream hStream, int *priority);
VGPU_CUDA_API CUresult cuStreamGetPriority_ptsz(CUstream hStream, int *priority);
VGPU_CUDA_API CUresult cuStreamGetFlags(CUstream hStream, unsigned int *flags);
VGPU_CUDA_API CUresult cuStreamGetFlags_ptsz(CUstream hStream, unsigned int *flags);
VGPU_CUDA_API CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx);
VGPU_CUDA_API CUresult cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx);
VGPU_CUDA_API CUresult cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void *userData,
                                           unsigned int flags);
VGPU_CUDA_API CUresult cuStreamAddCallback_ptsz(CUstream hStream, CUstreamCallback callback, void *userData,
                                                unsigned int flags);
VGPU_CUDA_API CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData);
VGPU_CUDA_API CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData);
VGPU_CUDA_API CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod, const char *name);
VGPU_CUDA_API CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *pCopy);
VGPU_CUDA_API CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *pCopy);
VGPU_CUDA_API CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *pCopy, CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D *pCopy);
VGPU_CUDA_API CUresult cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *pCopy, CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D *pCopy);
VGPU_CUDA_API CUresult cuMemcpy2DUnaligned_v2_ptds(const CUDA_MEMCPY2D *pCopy);
VGPU_CUDA_API CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *pCopy, CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpy3D_v2_ptds(const CUDA_MEMCPY3D *pCopy);
VGPU_CUDA_API CUresult cuMemcpy3DAsync_v2_ptsz(const CUDA_MEMCPY3D *pCopy, CUstream hStream);
VGPU_CUDA_API CUresult cuLinkCreate_v2(unsigned int numOptions, CUjit_option *options, void **optionValues,
                                       CUlinkState *stateOut);
VGPU_CUDA_API CUresult cuLinkAddData_v2(CUlinkState state, CUjitInputType type, void *data, size_t size,
                                        const char *name, unsigned int numOptions, CUjit_option *options,
                                        void **optionValues);
VGPU_CUDA_API CUresult cuLinkAddFile_v2(CUlinkState state, CUjitInputType type, const char *path,
                                        unsigned int numOptions, CUjit_option *options, void **optionValues);
VGPU_CUDA_API CUresult cuLinkComplete(CUlinkState state, void **cubinOut, size_t *sizeOut);
VGPU_CUDA_API CUresult cuLinkDestroy(CUlinkState state);
VGPU_CUDA_API CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr);
VGPU_CUDA_API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags);
VGPU_CUDA_API CUresult cuIpcCloseMemHandle(CUdeviceptr dptr);
VGPU_CUDA_API CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event);
VGPU_CUDA_API CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle);

/* ---- legacy ABI names: still exported by libcuda.so.1 for binaries built against old headers.
 * A new cuda.h #defines these names to their successors, so they can only be checked against it
 * with -D__CUDA_API_VERSION_INTERNAL (the test does so). ---- */
VGPU_CUDA_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
VGPU_CUDA_API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev);
VGPU_CUDA_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev);
VGPU_CUDA_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
VGPU_CUDA_API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                      unsigned int flags, CUdevice dev);
VGPU_CUDA_API CUresult cuMemGetInfo(unsigned int *free, unsigned int *total);
VGPU_CUDA_API CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize);
VGPU_CUDA_API CUresult cuMemFree(CUdeviceptr_v1 dptr);
VGPU_CUDA_API CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                       unsigned int Height, unsigned int ElementSizeBytes);
VGPU_CUDA_API CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd);
VGPU_CUDA_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
/* legacy names added with the simulator (same reason as above) */
VGPU_CUDA_API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev);
VGPU_CUDA_API CUresult cuCtxDestroy(CUcontext ctx);
VGPU_CUDA_API CUresult cuCtxPushCurrent(CUcontext ctx);
VGPU_CUDA_API CUresult cuCtxPopCurrent(CUcontext *pctx);
VGPU_CUDA_API CUresult cuDevicePrimaryCtxReset(CUdevice dev);
VGPU_CUDA_API CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags);
VGPU_CUDA_API CUresult cuStreamDestroy(CUstream hStream);
VGPU_CUDA_API CUresult cuEventDestroy(CUevent hEvent);
VGPU_CUDA_API CUresult cuMemAllocHost(void **pp, unsigned int bytesize);
VGPU_CUDA_API CUresult cuMemGetAddressRange(CUdeviceptr_v1 *pbase, unsigned int *psize, CUdeviceptr_v1 dptr);
VGPU_CUDA_API CUresult cuMemcpyHtoD(CUdeviceptr_v1 dstDevice, const void *srcHost, unsigned int ByteCount);
VGPU_CUDA_API CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr_v1 srcDevice, unsigned int ByteCount);
VGPU_CUDA_API CUresult cuMemcpyDtoD(CUdeviceptr_v1 dstDevice, CUdeviceptr_v1 srcDevice, unsigned int ByteCount);
VGPU_CUDA_API CUresult cuMemcpyHtoDAsync(CUdeviceptr_v1 dstDevice, const void *srcHost, unsigned int ByteCount,
                                         CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr_v1 srcDevice, unsigned int ByteCount,
                                         CUstream hStream);
VGPU_CUDA_API CUresult cuMemcpyDtoDAsync(CUdeviceptr_v1 dstDevice, CUdeviceptr_v1 srcDevice, unsigned int ByteCount,
                                         CUstream hStream);
VGPU_CUDA_API CUresult cuMemsetD8(CUdeviceptr_v1 dstDevice, unsigned char uc, unsigned int N);
VGPU_CUDA_API CUresult cuMemsetD32(CUdeviceptr_v1 dstDevice, unsigned int ui, unsigned int N);
VGPU_CUDA_API CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *pAllocateArray);
VGPU_CUDA_API CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *pAllocateArray);
VGPU_CUDA_API CUresult cuStreamBeginCapture(CUstream hStream);
VGPU_CUDA_API CUresult cuStreamBeginCapture_ptsz(CUstream hStream);
VGPU_CUDA_API CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                          char *logBuffer, size_t bufferSize);
VGPU_CUDA_API CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                             char *logBuffer, size_t bufferSize);

#ifdef __cplusplus
}
#endif

#endif /* VGPU_CUDA_API_H */

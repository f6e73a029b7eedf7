/*
 * Driver entry points the simulator exports beyond vgpu/cuda_api.h (the declarations the shim
 * shares): those NVIDIA's CUDA runtime and PyTorch resolve through cuGetProcAddress. Their
 * cuGetProcAddress rows are in procaddr_ext.def. Types the simulator never looks inside are
 * opaque here; the argument lists follow cuda.h (C linkage: only the register classes matter).
 */
#ifndef VGPU_SIM_API_EXT_H
#define VGPU_SIM_API_EXT_H

typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUdevResourceDesc_st *CUdevResourceDesc;
typedef struct CUdevResource_st CUdevResource; /* never dereferenced */
typedef struct CUmulticastObjectProp_st CUmulticastObjectProp;
typedef struct CUlogsCallbackEntry_st *CUlogsCallbackHandle;
typedef void (*CUlogsCallback)(void *data, int logLevel, char *message, size_t length);
typedef unsigned int CUlogIterator;
typedef struct CUstreamBatchMemOpParams_st CUstreamBatchMemOpParams;
typedef enum { CU_MODULE_EAGER_LOADING_SIM = 1, CU_MODULE_LAZY_LOADING_SIM = 2 } CUmoduleLoadingMode_sim;

/* shareable handles and allocation handles (vmm.c) */
VGPU_CUDA_API CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                    CUmemAllocationHandleType handleType, unsigned long long flags);
VGPU_CUDA_API CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                              CUmemGenericAllocationHandle handle);

/* stream memory operations (memops.c) */
VGPU_CUDA_API CUresult cuStreamWriteValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWriteValue32_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                                 unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWriteValue32_v2(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWriteValue32_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                                    unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWriteValue64(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWriteValue64_ptsz(CUstream stream, CUdeviceptr addr, cuuint64_t value,
                                                 unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWriteValue64_v2(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWriteValue64_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint64_t value,
                                                    unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWaitValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWaitValue32_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                                unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWaitValue32_v2(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWaitValue32_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                                   unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWaitValue64(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWaitValue64_ptsz(CUstream stream, CUdeviceptr addr, cuuint64_t value,
                                                unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWaitValue64_v2(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags);
VGPU_CUDA_API CUresult cuStreamWaitValue64_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint64_t value,
                                                   unsigned int flags);
VGPU_CUDA_API CUresult cuStreamBatchMemOp(CUstream stream, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                          unsigned int flags);
VGPU_CUDA_API CUresult cuStreamBatchMemOp_ptsz(CUstream stream, unsigned int count,
                                               CUstreamBatchMemOpParams *paramArray, unsigned int flags);
VGPU_CUDA_API CUresult cuStreamBatchMemOp_v2(CUstream stream, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                             unsigned int flags);
VGPU_CUDA_API CUresult cuStreamBatchMemOp_v2_ptsz(CUstream stream, unsigned int count,
                                                  CUstreamBatchMemOpParams *paramArray, unsigned int flags);

/* multicast objects and green contexts: not supported by the simulated devices (unsupported.c) */
VGPU_CUDA_API CUresult cuMulticastCreate(CUmemGenericAllocationHandle *mcHandle, const CUmulticastObjectProp *prop);
VGPU_CUDA_API CUresult cuMulticastAddDevice(CUmemGenericAllocationHandle mcHandle, CUdevice dev);
VGPU_CUDA_API CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                          CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                                          unsigned long long flags);
VGPU_CUDA_API CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUdeviceptr memptr,
                                           size_t size, unsigned long long flags);
VGPU_CUDA_API CUresult cuMulticastUnbind(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                         size_t size);
VGPU_CUDA_API CUresult cuMulticastGetGranularity(size_t *granularity, const CUmulticastObjectProp *prop, int option);
VGPU_CUDA_API CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags);
VGPU_CUDA_API CUresult cuGreenCtxDestroy(CUgreenCtx hCtx);
VGPU_CUDA_API CUresult cuGreenCtxStreamCreate(CUstream *phStream, CUgreenCtx greenCtx, unsigned int flags,
                                              int priority);
VGPU_CUDA_API CUresult cuCtxFromGreenCtx(CUcontext *pContext, CUgreenCtx hCtx);
VGPU_CUDA_API CUresult cuDeviceGetDevResource(CUdevice device, CUdevResource *resource, int type);
VGPU_CUDA_API CUresult cuDevSmResourceSplitByCount(CUdevResource *result, unsigned int *nbGroups,
                                                   const CUdevResource *input, CUdevResource *remaining,
                                                   unsigned int useFlags, unsigned int minCount);
VGPU_CUDA_API CUresult cuDevResourceGenerateDesc(CUdevResourceDesc *phDesc, CUdevResource *resources,
                                                 unsigned int nbResources);

/* driver logs (logs.c): callbacks are kept; the simulated driver logs nothing */
VGPU_CUDA_API CUresult cuLogsRegisterCallback(CUlogsCallback callbackFunc, void *userData,
                                              CUlogsCallbackHandle *callback_out);
VGPU_CUDA_API CUresult cuLogsUnregisterCallback(CUlogsCallbackHandle callback);
VGPU_CUDA_API CUresult cuLogsCurrent(CUlogIterator *iterator_out, unsigned int flags);
VGPU_CUDA_API CUresult cuLogsDumpToMemory(CUlogIterator *iterator, char *buffer, size_t *size, unsigned int flags);

/* thread block clusters (funcattr.c) */
VGPU_CUDA_API CUresult cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction func,
                                                          const CUlaunchConfig *config);
VGPU_CUDA_API CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func, const CUlaunchConfig *config);

/* events and capture (stream.c, graph.c) */
VGPU_CUDA_API CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags);
VGPU_CUDA_API CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags);
VGPU_CUDA_API CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode);

/* context and stream identity (ctxinfo.c) */
VGPU_CUDA_API CUresult cuCtxGetId(CUcontext ctx, unsigned long long *ctxId);

/* peer access: no P2P path between the simulated GPUs (peer.c) */
VGPU_CUDA_API CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev);
VGPU_CUDA_API CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int flags);
VGPU_CUDA_API CUresult cuCtxDisablePeerAccess(CUcontext peerContext);

/* several pointer attributes at once (memory.c); a kernel's library (module.c) */
VGPU_CUDA_API CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                              CUdeviceptr ptr);
VGPU_CUDA_API CUresult cuKernelGetLibrary(CUlibrary *pLib, CUkernel kernel);
VGPU_CUDA_API CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary library);

/* managed-memory prefetch: a hint, nothing to move (memory.c) */
VGPU_CUDA_API CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream);
VGPU_CUDA_API CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream);
VGPU_CUDA_API CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                             unsigned int flags, CUstream hStream);
VGPU_CUDA_API CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                                  unsigned int flags, CUstream hStream);

/* kernel-node parameters of graphs (graphnode.c) */
typedef struct CUDA_KERNEL_NODE_PARAMS_st CUDA_KERNEL_NODE_PARAMS;
VGPU_CUDA_API CUresult cuGraphKernelNodeGetParams(CUgraphNode hNode, CUDA_KERNEL_NODE_PARAMS *nodeParams);
VGPU_CUDA_API CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode hNode, CUDA_KERNEL_NODE_PARAMS *nodeParams);
VGPU_CUDA_API CUresult cuGraphExecKernelNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                      const CUDA_KERNEL_NODE_PARAMS *nodeParams);
VGPU_CUDA_API CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                         const CUDA_KERNEL_NODE_PARAMS *nodeParams);

/* tensor maps (tensormap.c): a header of their own, checked against cuda.h */
#include "tensormap_api.h"

#endif

/*
 * Features the simulated devices do not have, answered as a real driver answers on a GPU or
 * system without them (each entry point deliberately, by name: an unknown name stays unknown to
 * cuGetProcAddress, because the runtime trusts the answers of the names it finds).
 *
 *  - Multicast objects (NVLink SHARP; CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0):
 *    CUDA_ERROR_NOT_SUPPORTED.
 *  - Green contexts (SM partitions; the devices report no partitionable SM resource):
 *    CUDA_ERROR_NOT_SUPPORTED.
 * Arguments are checked first, so a NULL out-pointer is CUDA_ERROR_INVALID_VALUE as usual.
 */
#include "init.h"

static CUresult unsupported(int args_ok) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    return args_ok ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMulticastCreate(CUmemGenericAllocationHandle *mcHandle, const CUmulticastObjectProp *prop) {
    return unsupported(mcHandle && prop);
}
SIM_EXPORT CUresult cuMulticastAddDevice(CUmemGenericAllocationHandle mcHandle, CUdevice dev) { return unsupported(1); }
SIM_EXPORT CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                       CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                                       unsigned long long flags) {
    return unsupported(1);
}
SIM_EXPORT CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUdeviceptr memptr,
                                        size_t size, unsigned long long flags) {
    return unsupported(1);
}
SIM_EXPORT CUresult cuMulticastUnbind(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset,
                                      size_t size) {
    return unsupported(1);
}
SIM_EXPORT CUresult cuMulticastGetGranularity(size_t *granularity, const CUmulticastObjectProp *prop, int option) {
    return unsupported(granularity && prop);
}

SIM_EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags) {
    return unsupported(phCtx != NULL);
}
SIM_EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx hCtx) { return unsupported(1); }
SIM_EXPORT CUresult cuGreenCtxStreamCreate(CUstream *phStream, CUgreenCtx greenCtx, unsigned int flags, int priority) {
    return unsupported(phStream != NULL);
}
SIM_EXPORT CUresult cuCtxFromGreenCtx(CUcontext *pContext, CUgreenCtx hCtx) { return unsupported(pContext != NULL); }
SIM_EXPORT CUresult cuDeviceGetDevResource(CUdevice device, CUdevResource *resource, int type) {
    return unsupported(resource != NULL);
}
SIM_EXPORT CUresult cuDevSmResourceSplitByCount(CUdevResource *result, unsigned int *nbGroups,
                                                const CUdevResource *input, CUdevResource *remaining,
                                                unsigned int useFlags, unsigned int minCount) {
    return unsupported(nbGroups && input);
}
SIM_EXPORT CUresult cuDevResourceGenerateDesc(CUdevResourceDesc *phDesc, CUdevResource *resources,
                                              unsigned int nbResources) {
    return unsupported(phDesc && resources);
}

/*
 * Peer access between devices. The simulated GPUs sit on PCIe with no P2P path (no NVLink, and
 * peer-to-peer over PCIe is off, as on most virtualised and many bare-metal nodes), so every pair
 * answers "cannot access", enabling is refused as the driver refuses it on such a pair, and
 * disabling finds nothing enabled. cuBLASLt resolves these at its driver initialisation.
 */
#include "ctxstack.h"
#include "init.h"

#define ERROR_PEER_ACCESS_UNSUPPORTED 217 /* CUDA_ERROR_PEER_ACCESS_UNSUPPORTED */
#define ERROR_PEER_ACCESS_NOT_ENABLED 705 /* CUDA_ERROR_PEER_ACCESS_NOT_ENABLED */

SIM_EXPORT CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
    if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc == CUDA_SUCCESS) rc = sim_check_device(peerDev);
    if (rc != CUDA_SUCCESS) return rc;
    *canAccessPeer = 0;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int flags) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (!peerContext) return CUDA_ERROR_INVALID_HANDLE;
    return (CUresult)ERROR_PEER_ACCESS_UNSUPPORTED;
}

SIM_EXPORT CUresult cuCtxDisablePeerAccess(CUcontext peerContext) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!peerContext) return CUDA_ERROR_INVALID_HANDLE;
    return (CUresult)ERROR_PEER_ACCESS_NOT_ENABLED;
}

/*
 * CUDA IPC (cuIpcGetMemHandle & co) is not modelled: the simulator's device memory is private
 * memory of each process, so another process cannot map it. Every IPC entry point checks its
 * arguments and answers CUDA_ERROR_NOT_SUPPORTED, which real drivers also return where IPC is
 * unavailable (e.g. some virtualised GPUs); clients (cuda.core, CuPy) treat it as "no IPC".
 */
#include "init.h"

SIM_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
    if (!pHandle || !dptr) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
    (void)handle;
    if (!pdptr || Flags > 1) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event) {
    if (!pHandle || !event) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle) {
    (void)handle;
    if (!phEvent) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_NOT_SUPPORTED;
}

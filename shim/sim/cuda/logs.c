/*
 * Driver logs (CUDA 12.9): a program may register callbacks for the driver's error log. The
 * simulated driver keeps the registrations and has nothing to log, so no callback ever runs and
 * the current log is empty.
 */
#include "api.h"

#include <stdlib.h>

struct CUlogsCallbackEntry_st {
    uint32_t magic;
    CUlogsCallback fn;
    void *data;
};

#define MAGIC_LOGCB 0x5c7c10c5u

SIM_EXPORT CUresult cuLogsRegisterCallback(CUlogsCallback callbackFunc, void *userData,
                                           CUlogsCallbackHandle *callback_out) {
    if (!callbackFunc || !callback_out) return CUDA_ERROR_INVALID_VALUE;
    struct CUlogsCallbackEntry_st *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = MAGIC_LOGCB;
    e->fn = callbackFunc;
    e->data = userData;
    *callback_out = e;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLogsUnregisterCallback(CUlogsCallbackHandle callback) {
    if (!callback || callback->magic != MAGIC_LOGCB) return CUDA_ERROR_INVALID_VALUE;
    callback->magic = 0; /* kept: a stale handle fails this check instead of touching freed memory */
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLogsCurrent(CUlogIterator *iterator_out, unsigned int flags) {
    if (!iterator_out || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    *iterator_out = 0; /* nothing logged so far */
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLogsDumpToMemory(CUlogIterator *iterator, char *buffer, size_t *size, unsigned int flags) {
    if (!buffer || !size || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (*size) buffer[0] = '\0';
    *size = 0;
    return CUDA_SUCCESS;
}

/*
 * Stream memory operations: cuStreamWriteValue32/64 write a word of device memory in stream
 * order. As with copies (copy.c), the simulator moves the data at the call; a word written into
 * a stream under capture is refused (no memory-operation graph nodes). The wait operations are
 * not exported: no device code ever writes the word a stream would wait for.
 */
#include "cuda_internal.h"

static CUresult write_value(CUstream stream, CUdeviceptr addr, const void *value, size_t n, unsigned flags, int ptds)
{
    if (flags & ~1u) /* CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER */
        return CUDA_ERROR_INVALID_VALUE;
    if (!addr || addr % n)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct CUstream_st *s;
    if ((rc = sim_resolve_stream(stream, ptds, &s)) != CUDA_SUCCESS)
        return rc;
    if (s->capturing)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if ((rc = sim_check_device_range(addr, n)) != CUDA_SUCCESS)
        return rc;
    return sim_copy_exec(addr, value, 0, NULL, n);
}

SIM_EXPORT CUresult cuStreamWriteValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags)
{ return write_value(stream, addr, &value, sizeof value, flags, 0); }
SIM_EXPORT CUresult cuStreamWriteValue32_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags)
{ return write_value(stream, addr, &value, sizeof value, flags, 1); }
SIM_EXPORT CUresult cuStreamWriteValue32_v2(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags)
{ return write_value(stream, addr, &value, sizeof value, flags, 0); }
SIM_EXPORT CUresult cuStreamWriteValue32_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags)
{ return write_value(stream, addr, &value, sizeof value, flags, 1); }
SIM_EXPORT CUresult cuStreamWriteValue64(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags)
{ return write_value(stream, addr, &value, sizeof value, flags, 0); }
SIM_EXPORT CUresult cuStreamWriteValue64_ptsz(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags)
{ return write_value(stream, addr, &value, sizeof value, flags, 1); }
SIM_EXPORT CUresult cuStreamWriteValue64_v2(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags)
{ return write_value(stream, addr, &value, sizeof value, flags, 0); }
SIM_EXPORT CUresult cuStreamWriteValue64_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags)
{ return write_value(stream, addr, &value, sizeof value, flags, 1); }

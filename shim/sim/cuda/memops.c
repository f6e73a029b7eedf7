/*
 * Stream memory operations: cuStreamWriteValue32/64 write a word of device memory in stream
 * order. As with copies (copy.c), the simulator moves the data at the call; a word written into
 * a stream under capture is refused (no memory-operation graph nodes).
 *
 * cuStreamWaitValue32/64 and the wait operations of cuStreamBatchMemOp test the word at the call:
 * everything queued before has already moved its data, so a condition that holds then is met in
 * stream order. A condition that does not hold would stall the stream until some other agent
 * writes the word; no device code runs here to write it, so the simulator answers
 * CUDA_ERROR_NOT_SUPPORTED instead of hanging the stream (docs/simulator.md, fidelity limits).
 * cuBLASLt resolves these entry points at its driver initialisation and refuses a driver without
 * them.
 */
#include "copy.h"
#include "init.h"
#include "memory.h"
#include "stream.h"

#include <string.h>

/* The checks every memory operation makes: flags within `allowed`, an aligned word of device
 * memory, a stream that is not capturing (no memory-operation graph nodes). */
static CUresult check_word(CUstream stream, CUdeviceptr addr, size_t n, unsigned flags, unsigned allowed, int ptds) {
    if (flags & ~allowed) return CUDA_ERROR_INVALID_VALUE;
    if (!addr || addr % n) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    struct CUstream_st *s;
    if ((rc = sim_resolve_stream(stream, ptds, &s)) != CUDA_SUCCESS) return rc;
    if (s->capturing) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return sim_check_device_range(addr, n);
}

static CUresult write_value(CUstream stream, CUdeviceptr addr, const void *value, size_t n, unsigned flags, int ptds) {
    CUresult rc = check_word(stream, addr, n, flags, 1u /* CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER */, ptds);
    return rc != CUDA_SUCCESS ? rc : sim_copy_exec(addr, value, 0, NULL, n);
}

SIM_EXPORT CUresult cuStreamWriteValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
    return write_value(stream, addr, &value, sizeof value, flags, 0);
}
SIM_EXPORT CUresult cuStreamWriteValue32_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
    return write_value(stream, addr, &value, sizeof value, flags, 1);
}
SIM_EXPORT CUresult cuStreamWriteValue32_v2(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
    return write_value(stream, addr, &value, sizeof value, flags, 0);
}
SIM_EXPORT CUresult cuStreamWriteValue32_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                                 unsigned int flags) {
    return write_value(stream, addr, &value, sizeof value, flags, 1);
}
SIM_EXPORT CUresult cuStreamWriteValue64(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
    return write_value(stream, addr, &value, sizeof value, flags, 0);
}
SIM_EXPORT CUresult cuStreamWriteValue64_ptsz(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
    return write_value(stream, addr, &value, sizeof value, flags, 1);
}
SIM_EXPORT CUresult cuStreamWriteValue64_v2(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
    return write_value(stream, addr, &value, sizeof value, flags, 0);
}
SIM_EXPORT CUresult cuStreamWriteValue64_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint64_t value,
                                                 unsigned int flags) {
    return write_value(stream, addr, &value, sizeof value, flags, 1);
}

#define WAIT_FLAGS_MASK 3u         /* CU_STREAM_WAIT_VALUE_GEQ 0, _EQ 1, _AND 2, _NOR 3 */
#define WAIT_FLAG_FLUSH (1u << 30) /* CU_STREAM_WAIT_VALUE_FLUSH */

static int condition_holds(uint64_t word, uint64_t value, unsigned flags, size_t n) {
    uint64_t mask = n == 4 ? 0xffffffffull : ~0ull;
    word &= mask;
    value &= mask;
    switch (flags & WAIT_FLAGS_MASK) {
    case 0:
        return n == 4 ? (int32_t)((uint32_t)word - (uint32_t)value) >= 0
                      : (int64_t)(word - value) >= 0; /* GEQ, wrapping */
    case 1: return word == value;
    case 2: return (word & value) != 0;
    default: return (~(word | value) & mask) != 0;
    }
}

static CUresult wait_value(CUstream stream, CUdeviceptr addr, uint64_t value, size_t n, unsigned flags, int ptds) {
    CUresult rc = check_word(stream, addr, n, flags, WAIT_FLAGS_MASK | WAIT_FLAG_FLUSH, ptds);
    if (rc != CUDA_SUCCESS) return rc;
    uint64_t word = 0;
    sim_copy_exec(0, NULL, addr, &word, n);
    return condition_holds(word, value, flags, n) ? CUDA_SUCCESS : CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuStreamWaitValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
    return wait_value(stream, addr, value, 4, flags, 0);
}
SIM_EXPORT CUresult cuStreamWaitValue32_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
    return wait_value(stream, addr, value, 4, flags, 1);
}
SIM_EXPORT CUresult cuStreamWaitValue32_v2(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
    return wait_value(stream, addr, value, 4, flags, 0);
}
SIM_EXPORT CUresult cuStreamWaitValue32_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                                unsigned int flags) {
    return wait_value(stream, addr, value, 4, flags, 1);
}
SIM_EXPORT CUresult cuStreamWaitValue64(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
    return wait_value(stream, addr, value, 8, flags, 0);
}
SIM_EXPORT CUresult cuStreamWaitValue64_ptsz(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
    return wait_value(stream, addr, value, 8, flags, 1);
}
SIM_EXPORT CUresult cuStreamWaitValue64_v2(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
    return wait_value(stream, addr, value, 8, flags, 0);
}
SIM_EXPORT CUresult cuStreamWaitValue64_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint64_t value,
                                                unsigned int flags) {
    return wait_value(stream, addr, value, 8, flags, 1);
}

/* CUstreamBatchMemOpParams: a 48-byte union whose members start with the operation; waits and
 * writes hold the address at byte 8, the value at 16 and the flags at 24 (cuda.h). */
enum { OP_WAIT_32 = 1, OP_WRITE_32 = 2, OP_FLUSH_REMOTE_WRITES = 3, OP_WAIT_64 = 4, OP_WRITE_64 = 5, OP_BARRIER = 6 };
#define BATCH_OP_SIZE 48

static CUresult batch(CUstream stream, unsigned count, const CUstreamBatchMemOpParams *ops, unsigned flags, int ptds) {
    if (!count || !ops || flags) return CUDA_ERROR_INVALID_VALUE;
    const unsigned char *p = (const unsigned char *)ops;
    for (unsigned i = 0; i < count; i++, p += BATCH_OP_SIZE) {
        uint32_t op, f;
        CUdeviceptr addr;
        uint64_t value;
        memcpy(&op, p, sizeof op);
        memcpy(&addr, p + 8, sizeof addr);
        memcpy(&value, p + 16, sizeof value);
        memcpy(&f, p + 24, sizeof f);
        CUresult rc;
        switch (op) {
        case OP_WAIT_32: rc = wait_value(stream, addr, value, 4, f, ptds); break;
        case OP_WAIT_64: rc = wait_value(stream, addr, value, 8, f, ptds); break;
        case OP_WRITE_32: {
            uint32_t v = (uint32_t)value;
            rc = write_value(stream, addr, &v, sizeof v, f, ptds);
            break;
        }
        case OP_WRITE_64: rc = write_value(stream, addr, &value, sizeof value, f, ptds); break;
        case OP_FLUSH_REMOTE_WRITES:
        case OP_BARRIER: rc = CUDA_SUCCESS; break; /* the data already moved at the call */
        default: rc = CUDA_ERROR_INVALID_VALUE; break;
        }
        if (rc != CUDA_SUCCESS) return rc;
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamBatchMemOp(CUstream stream, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                       unsigned int flags) {
    return batch(stream, count, paramArray, flags, 0);
}
SIM_EXPORT CUresult cuStreamBatchMemOp_ptsz(CUstream stream, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                            unsigned int flags) {
    return batch(stream, count, paramArray, flags, 1);
}
SIM_EXPORT CUresult cuStreamBatchMemOp_v2(CUstream stream, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                          unsigned int flags) {
    return batch(stream, count, paramArray, flags, 0);
}
SIM_EXPORT CUresult cuStreamBatchMemOp_v2_ptsz(CUstream stream, unsigned int count,
                                               CUstreamBatchMemOpParams *paramArray, unsigned int flags) {
    return batch(stream, count, paramArray, flags, 1);
}

/*
 * Tensor maps: the host side of Hopper's tensor memory accelerator. A real driver checks the
 * arguments against the rules of cuda.h's documentation and packs them into an opaque 128-byte
 * descriptor that kernels read; it needs no context and touches no device memory. The simulator
 * runs no kernel, so its descriptor only has to carry what cuTensorMapReplaceAddress needs (the
 * address and the alignment the encoding asked of it) and be the same for the same arguments.
 * Every rule of the documentation that concerns the arguments alone is checked and answers
 * CUDA_ERROR_INVALID_VALUE, as the driver does (tests/sim/test_tensor_maps.py).
 */
#include "api.h"
#include "init.h"

#include <string.h>

#define TMAP_MAGIC    0x53494d544d415031ull /* "SIMTMAP1": a descriptor this driver encoded */
#define TMAP_MAX_RANK 5
#define TMAP_TYPES    16 /* CU_TENSOR_MAP_DATA_TYPE_UINT8 .. _16U6_ALIGN16B */

/* Descriptor layout (opaque to programs): magic, address, the address alignment the encoding
 * requires, kind and small fields, then the dimensions. */
enum { Q_MAGIC, Q_ADDR, Q_ALIGN, Q_FIELDS, Q_DIMS };

/* Bits per element: the packed types count their values (4 or 6 bits), padded as stored. */
static unsigned type_bits(CUtensorMapDataType t) {
    static const unsigned bits[TMAP_TYPES] = {8, 16, 32, 32, 64, 64, 16, 32, 64, 16, 32, 32, 32, 4, 8, 8};
    return bits[t];
}

static int is_float(CUtensorMapDataType t) {
    return t == CU_TENSOR_MAP_DATA_TYPE_FLOAT16 || t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ||
           t == CU_TENSOR_MAP_DATA_TYPE_FLOAT64 || t == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ||
           t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ || t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 ||
           t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ;
}

static int is_align16_packed(CUtensorMapDataType t) {
    return t == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B || t == CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B;
}

/* The rules shared by the tiled and the im2col forms: enums, the address, the global dimensions
 * and strides, the element strides, swizzle against interleave and type. `inner` is the bounding
 * box's inner dimension in elements (boxDim[0], or channelsPerPixel for im2col). 0 if all hold. */
static int check_common(const CUtensorMap *tensorMap, CUtensorMapDataType type, cuuint32_t rank, void *address,
                        const cuuint64_t *globalDim, const cuuint64_t *globalStrides, cuuint64_t inner,
                        const cuuint32_t *elementStrides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                        CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob, uint64_t *align_out) {
    if (!tensorMap || ((uintptr_t)tensorMap & 63) != 0) return -1;
    if ((unsigned)type >= TMAP_TYPES || (unsigned)interleave > CU_TENSOR_MAP_INTERLEAVE_32B ||
        (unsigned)swizzle > CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B || (unsigned)l2 > CU_TENSOR_MAP_L2_PROMOTION_L2_256B ||
        (unsigned)oob > CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA)
        return -1;
    if (rank == 0 || rank > TMAP_MAX_RANK) return -1;
    if (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE && rank < 3) return -1;
    if (!globalDim || !elementStrides || (rank > 1 && !globalStrides)) return -1;
    int packed16 = is_align16_packed(type);
    uint64_t align = (interleave == CU_TENSOR_MAP_INTERLEAVE_32B || packed16) ? 32 : 16;
    if (((uintptr_t)address & (align - 1)) != 0) return -1;
    for (cuuint32_t i = 0; i < rank; i++) {
        if (globalDim[i] == 0 || globalDim[i] > (1ull << 32)) return -1;
        if (elementStrides[i] == 0 || elementStrides[i] > 8) return -1;
    }
    if (packed16 && globalDim[0] % 128 != 0) return -1;
    if (type == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B && globalDim[0] % 2 != 0) return -1;
    uint64_t stride_align = (interleave == CU_TENSOR_MAP_INTERLEAVE_32B || packed16) ? 32 : 16;
    for (cuuint32_t i = 0; i + 1 < rank; i++)
        if (globalStrides[i] % stride_align != 0 || globalStrides[i] >= (1ull << 40)) return -1;
    /* swizzle: the box's inner dimension in bytes fits the swizzle span */
    uint64_t inner_bytes = (inner * type_bits(type) + 7) / 8;
    if (interleave == CU_TENSOR_MAP_INTERLEAVE_NONE && swizzle != CU_TENSOR_MAP_SWIZZLE_NONE) {
        uint64_t span = swizzle == CU_TENSOR_MAP_SWIZZLE_32B ? 32 : swizzle == CU_TENSOR_MAP_SWIZZLE_64B ? 64 : 128;
        if (inner_bytes > span) return -1;
    }
    if (interleave == CU_TENSOR_MAP_INTERLEAVE_32B && swizzle != CU_TENSOR_MAP_SWIZZLE_32B) return -1;
    if (type == CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B) {
        if (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE) return -1;
        if (swizzle != CU_TENSOR_MAP_SWIZZLE_NONE && swizzle != CU_TENSOR_MAP_SWIZZLE_128B &&
            swizzle != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B && swizzle != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B)
            return -1;
    }
    if (type == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B && swizzle != CU_TENSOR_MAP_SWIZZLE_NONE &&
        swizzle != CU_TENSOR_MAP_SWIZZLE_128B && swizzle != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B)
        return -1;
    if (oob == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA && !is_float(type)) return -1;
    *align_out = align;
    return 0;
}

static void encode(CUtensorMap *tensorMap, int kind, CUtensorMapDataType type, cuuint32_t rank, void *address,
                   uint64_t align, const cuuint64_t *globalDim, const cuuint64_t *globalStrides, const cuuint32_t *box,
                   const cuuint32_t *elementStrides, unsigned interleave, unsigned swizzle, unsigned l2, unsigned oob) {
    memset(tensorMap, 0, sizeof *tensorMap);
    cuuint64_t *q = tensorMap->opaque;
    q[Q_MAGIC] = TMAP_MAGIC;
    q[Q_ADDR] = (cuuint64_t)(uintptr_t)address;
    q[Q_ALIGN] = align;
    q[Q_FIELDS] = (cuuint64_t)kind | (cuuint64_t)type << 4 | (cuuint64_t)rank << 12 | (cuuint64_t)interleave << 16 |
                  (cuuint64_t)swizzle << 20 | (cuuint64_t)l2 << 24 | (cuuint64_t)oob << 28;
    /* per dimension: the size, the stride of the next (0 past the last), box and element stride */
    for (cuuint32_t i = 0; i < rank && Q_DIMS + 2 * i + 1 < CU_TENSOR_MAP_NUM_QWORDS; i++) {
        q[Q_DIMS + 2 * i] = globalDim[i];
        q[Q_DIMS + 2 * i + 1] =
            (i + 1 < rank ? globalStrides[i] : 0) << 16 | (cuuint64_t)(box ? box[i] : 0) << 4 | elementStrides[i];
    }
}

SIM_EXPORT CUresult cuTensorMapEncodeTiled(CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType,
                                           cuuint32_t tensorRank, void *globalAddress, const cuuint64_t *globalDim,
                                           const cuuint64_t *globalStrides, const cuuint32_t *boxDim,
                                           const cuuint32_t *elementStrides, CUtensorMapInterleave interleave,
                                           CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
                                           CUtensorMapFloatOOBfill oobFill) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!boxDim || tensorRank == 0 || tensorRank > TMAP_MAX_RANK) return CUDA_ERROR_INVALID_VALUE;
    uint64_t align;
    if (check_common(tensorMap, tensorDataType, tensorRank, globalAddress, globalDim, globalStrides, boxDim[0],
                     elementStrides, interleave, swizzle, l2Promotion, oobFill, &align) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (cuuint32_t i = 0; i < tensorRank; i++)
        if (boxDim[i] == 0 || boxDim[i] > 256) return CUDA_ERROR_INVALID_VALUE;
    if (interleave == CU_TENSOR_MAP_INTERLEAVE_NONE && ((uint64_t)boxDim[0] * type_bits(tensorDataType)) % 128 != 0)
        return CUDA_ERROR_INVALID_VALUE; /* the inner box is a multiple of 16 bytes */
    if (is_align16_packed(tensorDataType) && boxDim[0] != 128) return CUDA_ERROR_INVALID_VALUE;
    encode(tensorMap, 1, tensorDataType, tensorRank, globalAddress, align, globalDim, globalStrides, boxDim,
           elementStrides, interleave, swizzle, l2Promotion, oobFill);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuTensorMapEncodeIm2col(CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType,
                                            cuuint32_t tensorRank, void *globalAddress, const cuuint64_t *globalDim,
                                            const cuuint64_t *globalStrides, const int *pixelBoxLowerCorner,
                                            const int *pixelBoxUpperCorner, cuuint32_t channelsPerPixel,
                                            cuuint32_t pixelsPerColumn, const cuuint32_t *elementStrides,
                                            CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                            CUtensorMapL2promotion l2Promotion, CUtensorMapFloatOOBfill oobFill) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (tensorRank < 3 || tensorRank > TMAP_MAX_RANK) return CUDA_ERROR_INVALID_VALUE;
    if (!pixelBoxLowerCorner || !pixelBoxUpperCorner) return CUDA_ERROR_INVALID_VALUE;
    uint64_t align;
    if (check_common(tensorMap, tensorDataType, tensorRank, globalAddress, globalDim, globalStrides, channelsPerPixel,
                     elementStrides, interleave, swizzle, l2Promotion, oobFill, &align) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    /* the corners' offsets: one per spatial dimension (D, H, W), their range narrowing with the rank */
    int limit = tensorRank == 3 ? 32768 : tensorRank == 4 ? 128 : 16;
    for (cuuint32_t i = 0; i < tensorRank - 2; i++)
        if (pixelBoxLowerCorner[i] < -limit || pixelBoxLowerCorner[i] >= limit || pixelBoxUpperCorner[i] < -limit ||
            pixelBoxUpperCorner[i] >= limit)
            return CUDA_ERROR_INVALID_VALUE;
    if (channelsPerPixel == 0 || channelsPerPixel > 256 || pixelsPerColumn == 0 || pixelsPerColumn > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (is_align16_packed(tensorDataType) && channelsPerPixel != 128) return CUDA_ERROR_INVALID_VALUE;
    encode(tensorMap, 2, tensorDataType, tensorRank, globalAddress, align, globalDim, globalStrides, NULL,
           elementStrides, interleave, swizzle, l2Promotion, oobFill);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuTensorMapReplaceAddress(CUtensorMap *tensorMap, void *globalAddress) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!tensorMap || ((uintptr_t)tensorMap & 63) != 0) return CUDA_ERROR_INVALID_VALUE;
    cuuint64_t *q = tensorMap->opaque;
    /* only a descriptor an encode call filled (or a copy of one) says what alignment holds */
    if (q[Q_MAGIC] != TMAP_MAGIC || (q[Q_ALIGN] != 16 && q[Q_ALIGN] != 32)) return CUDA_ERROR_INVALID_VALUE;
    if (((uintptr_t)globalAddress & (q[Q_ALIGN] - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
    q[Q_ADDR] = (cuuint64_t)(uintptr_t)globalAddress;
    return CUDA_SUCCESS;
}

/*
 * Tensor maps (CUDA 12.0, Hopper's TMA): cuTensorMapEncodeTiled, cuTensorMapEncodeIm2col and
 * cuTensorMapReplaceAddress fill a 128-byte descriptor on the host; a kernel reads it. Programs
 * and libraries link them by name (vLLM's _C_stable_libtorch, FlashAttention 3, torch's NVRTC
 * library), so a driver without them fails their load. Types and names as NVIDIA's cuda.h;
 * tests/sim/test_tensor_maps.py compiles these prototypes after cuda.h (CUDA 12 and 13) with
 * VGPU_CHECK_AGAINST_CUDA_H defined, which then supplies the types.
 */
#ifndef VGPU_SIM_TENSORMAP_API_H
#define VGPU_SIM_TENSORMAP_API_H

#ifndef VGPU_CHECK_AGAINST_CUDA_H

#define CU_TENSOR_MAP_NUM_QWORDS 16

typedef struct CUtensorMap_st {
    _Alignas(64) cuuint64_t opaque[CU_TENSOR_MAP_NUM_QWORDS];
} CUtensorMap;

typedef enum CUtensorMapDataType_enum {
    CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0,
    CU_TENSOR_MAP_DATA_TYPE_UINT16,
    CU_TENSOR_MAP_DATA_TYPE_UINT32,
    CU_TENSOR_MAP_DATA_TYPE_INT32,
    CU_TENSOR_MAP_DATA_TYPE_UINT64,
    CU_TENSOR_MAP_DATA_TYPE_INT64,
    CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
    CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ,
    CU_TENSOR_MAP_DATA_TYPE_TFLOAT32,
    CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ,
    CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B,
    CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B,
    CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B
} CUtensorMapDataType;

typedef enum CUtensorMapInterleave_enum {
    CU_TENSOR_MAP_INTERLEAVE_NONE = 0,
    CU_TENSOR_MAP_INTERLEAVE_16B,
    CU_TENSOR_MAP_INTERLEAVE_32B
} CUtensorMapInterleave;

typedef enum CUtensorMapSwizzle_enum {
    CU_TENSOR_MAP_SWIZZLE_NONE = 0,
    CU_TENSOR_MAP_SWIZZLE_32B,
    CU_TENSOR_MAP_SWIZZLE_64B,
    CU_TENSOR_MAP_SWIZZLE_128B,
    CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B,
    CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B_FLIP_8B,
    CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B
} CUtensorMapSwizzle;

typedef enum CUtensorMapL2promotion_enum {
    CU_TENSOR_MAP_L2_PROMOTION_NONE = 0,
    CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
    CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
    CU_TENSOR_MAP_L2_PROMOTION_L2_256B
} CUtensorMapL2promotion;

typedef enum CUtensorMapFloatOOBfill_enum {
    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0,
    CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
} CUtensorMapFloatOOBfill;

#endif /* VGPU_CHECK_AGAINST_CUDA_H */

VGPU_CUDA_API CUresult cuTensorMapEncodeTiled(CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType,
                                              cuuint32_t tensorRank, void *globalAddress, const cuuint64_t *globalDim,
                                              const cuuint64_t *globalStrides, const cuuint32_t *boxDim,
                                              const cuuint32_t *elementStrides, CUtensorMapInterleave interleave,
                                              CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
                                              CUtensorMapFloatOOBfill oobFill);
VGPU_CUDA_API CUresult cuTensorMapEncodeIm2col(CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType,
                                               cuuint32_t tensorRank, void *globalAddress, const cuuint64_t *globalDim,
                                               const cuuint64_t *globalStrides, const int *pixelBoxLowerCorner,
                                               const int *pixelBoxUpperCorner, cuuint32_t channelsPerPixel,
                                               cuuint32_t pixelsPerColumn, const cuuint32_t *elementStrides,
                                               CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                               CUtensorMapL2promotion l2Promotion, CUtensorMapFloatOOBfill oobFill);
VGPU_CUDA_API CUresult cuTensorMapReplaceAddress(CUtensorMap *tensorMap, void *globalAddress);

#endif

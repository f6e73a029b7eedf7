/*
 * Function and kernel attributes, cache configuration and occupancy. The simulator compiles no
 * code, so every kernel reports what a small compiled kernel on the device reports (32 registers,
 * no static shared/constant/local memory, PTX and binary version = the compute capability); the
 * settable attributes (max dynamic shared memory, carveout, cache config) are kept and read back.
 * Occupancy follows the per-SM limits of the device's compute capability (smlimits.c; on 9.0:
 * 2048 threads, 32 blocks, 65536 registers, 228 KiB shared memory, 227 KiB per block opt-in,
 * 1 KiB reserved per block), as the CUDA occupancy calculator does.
 */
#include "ctxstack.h"
#include "init.h"
#include "module.h"
#include "smlimits.h"

#define FN_REGS       32
#define BLOCK_THREADS 1024

static sim_sm_limits limits(int dev) { return sim_sm_limits_of(G.cfg->dev[dev].cc_major, G.cfg->dev[dev].cc_minor); }

static CUresult func_get(int *pi, CUfunction_attribute attrib, struct CUfunc_st *f, int dev) {
    const sim_device_cfg *d = &G.cfg->dev[dev];
    switch ((int)attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = BLOCK_THREADS; break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES:
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES:
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES:
    case CU_FUNC_ATTRIBUTE_CACHE_MODE_CA:
    case CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
    case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: *pi = f->nonportable_cluster; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = FN_REGS; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *pi = d->cc_major * 10 + d->cc_minor; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *pi = f->max_dyn_smem; break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *pi = f->carveout; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

static CUresult func_set(struct CUfunc_st *f, CUfunction_attribute attrib, int value, int dev) {
    switch ((int)attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        if (value < 0 || value > limits(dev).smem_optin) return CUDA_ERROR_INVALID_VALUE;
        f->max_dyn_smem = value;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
        if (value < -1 || value > 100) return CUDA_ERROR_INVALID_VALUE;
        f->carveout = value;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED:
        if (value < 0 || value > 1) return CUDA_ERROR_INVALID_VALUE;
        f->nonportable_cluster = value;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
    case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
        return value < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE; /* read-only attributes */
    }
}

/* A function in the current context (a module's function) or a kernel (any context). */
static CUresult resolve(CUfunction h, struct CUfunc_st **out, int *dev) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    struct CUfunc_st *f = sim_func_resolve(h);
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    *out = f;
    *dev = c->dev;
    return CUDA_SUCCESS;
}

static CUresult resolve_kernel(CUkernel k, CUdevice dev, struct CUfunc_st **out) {
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!k || k->fn.magic != MAGIC_KERNEL) return CUDA_ERROR_INVALID_HANDLE;
    *out = &k->fn;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc) {
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *f;
    int dev;
    CUresult rc = resolve(hfunc, &f, &dev);
    return rc != CUDA_SUCCESS ? rc : func_get(pi, attrib, f, dev);
}

SIM_EXPORT CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value) {
    struct CUfunc_st *f;
    int dev;
    CUresult rc = resolve(hfunc, &f, &dev);
    return rc != CUDA_SUCCESS ? rc : func_set(f, attrib, value, dev);
}

SIM_EXPORT CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config) {
    struct CUfunc_st *f;
    int dev;
    CUresult rc = resolve(hfunc, &f, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    if ((unsigned)config > CU_FUNC_CACHE_PREFER_EQUAL) return CUDA_ERROR_INVALID_VALUE;
    f->cache_config = config;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuFuncGetModule(CUmodule *hmod, CUfunction hfunc) {
    if (!hmod) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    struct CUfunc_st *f = sim_func_resolve(hfunc);
    if (!f || !f->mod) /* a library kernel has no module */
        return CUDA_ERROR_INVALID_HANDLE;
    *hmod = f->mod;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuFuncGetName(const char **name, CUfunction hfunc) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    struct CUfunc_st *f = sim_func_resolve(hfunc);
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    *name = f->name;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuKernelGetName(const char **name, CUkernel hfunc) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!hfunc || hfunc->fn.magic != MAGIC_KERNEL) return CUDA_ERROR_INVALID_HANDLE;
    *name = hfunc->fn.name;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuKernelGetAttribute(int *pi, CUfunction_attribute attrib, CUkernel kernel, CUdevice dev) {
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *f;
    CUresult rc = resolve_kernel(kernel, dev, &f);
    return rc != CUDA_SUCCESS ? rc : func_get(pi, attrib, f, dev);
}

SIM_EXPORT CUresult cuKernelSetAttribute(CUfunction_attribute attrib, int val, CUkernel kernel, CUdevice dev) {
    struct CUfunc_st *f;
    CUresult rc = resolve_kernel(kernel, dev, &f);
    return rc != CUDA_SUCCESS ? rc : func_set(f, attrib, val, dev);
}

SIM_EXPORT CUresult cuKernelSetCacheConfig(CUkernel kernel, CUfunc_cache config, CUdevice dev) {
    struct CUfunc_st *f;
    CUresult rc = resolve_kernel(kernel, dev, &f);
    if (rc != CUDA_SUCCESS) return rc;
    if ((unsigned)config > CU_FUNC_CACHE_PREFER_EQUAL) return CUDA_ERROR_INVALID_VALUE;
    f->cache_config = config;
    return CUDA_SUCCESS;
}

/* Resident blocks of blockSize threads per SM (0: the block cannot run). */
static int blocks_per_sm(const struct CUfunc_st *f, int dev, int blockSize, size_t smem) {
    sim_sm_limits sm = limits(dev);
    /* the hardware's answer: the function's dynamic shared memory limit is checked at launch,
     * not here (cuBLAS sizes its kernels by asking before it raises the limit) */
    if (blockSize <= 0 || blockSize > BLOCK_THREADS || smem > (size_t)sm.smem_optin) return 0;
    int warps = (blockSize + 31) / 32;
    int by_threads = sm.threads / (warps * 32);
    int by_regs = sm.regs / (warps * 32 * FN_REGS);
    int by_smem = smem ? (int)((size_t)sm.smem / (sim_align_up(smem, 1024) + (size_t)sm.smem_reserved)) : sm.blocks;
    int n = by_threads < by_regs ? by_threads : by_regs;
    n = n < by_smem ? n : by_smem;
    return n < sm.blocks ? n : sm.blocks;
}

static CUresult occupancy(int *numBlocks, CUfunction func, int blockSize, size_t smem) {
    if (!numBlocks) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *f;
    int dev;
    CUresult rc = resolve(func, &f, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (blockSize <= 0 || blockSize > BLOCK_THREADS) return CUDA_ERROR_INVALID_VALUE;
    *numBlocks = blocks_per_sm(f, dev, blockSize, smem);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func, int blockSize,
                                                                size_t dynamicSMemSize) {
    return occupancy(numBlocks, func, blockSize, dynamicSMemSize);
}

SIM_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *numBlocks, CUfunction func, int blockSize,
                                                                         size_t dynamicSMemSize, unsigned int flags) {
    if (flags > 1) /* CU_OCCUPANCY_DEFAULT, CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE */
        return CUDA_ERROR_INVALID_VALUE;
    return occupancy(numBlocks, func, blockSize, dynamicSMemSize);
}

static CUresult potential(int *minGridSize, int *blockSize, CUfunction func, CUoccupancyB2DSize b2d, size_t smem,
                          int limit, unsigned flags) {
    if (!minGridSize || !blockSize || flags > 1) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *f;
    int dev;
    CUresult rc = resolve(func, &f, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    int max = limit > 0 && limit < BLOCK_THREADS ? limit : BLOCK_THREADS;
    int best = 0, best_blocks = 0, best_threads = 0;
    for (int bs = max; bs > 0; bs -= (bs % 32 ? bs % 32 : 32)) {
        int n = blocks_per_sm(f, dev, bs, b2d ? b2d(bs) : smem);
        if (n * bs > best_threads) {
            best_threads = n * bs;
            best = bs;
            best_blocks = n;
        }
    }
    *blockSize = best;
    *minGridSize = best_blocks * G.cfg->dev[dev].sm_count;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                                     CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                     size_t dynamicSMemSize, int blockSizeLimit) {
    return potential(minGridSize, blockSize, func, blockSizeToDynamicSMemSize, dynamicSMemSize, blockSizeLimit, 0);
}

SIM_EXPORT CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *minGridSize, int *blockSize, CUfunction func,
                                                              CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                              size_t dynamicSMemSize, int blockSizeLimit,
                                                              unsigned int flags) {
    return potential(minGridSize, blockSize, func, blockSizeToDynamicSMemSize, dynamicSMemSize, blockSizeLimit, flags);
}

SIM_EXPORT CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *dynamicSmemSize, CUfunction func, int numBlocks,
                                                            int blockSize) {
    if (!dynamicSmemSize) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *f;
    int dev;
    CUresult rc = resolve(func, &f, &dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (numBlocks <= 0 || blockSize <= 0 || blockSize > BLOCK_THREADS ||
        blocks_per_sm(f, dev, blockSize, 0) < numBlocks)
        return CUDA_ERROR_INVALID_VALUE;
    /* what the hardware leaves each block: the function's opt-in limit does not cap the answer
     * (cuBLAS asks first, then raises CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES to it) */
    sim_sm_limits sm = limits(dev);
    size_t per = (size_t)sm.smem / (size_t)numBlocks, reserved = (size_t)sm.smem_reserved;
    per = per > reserved ? (per - reserved) / 1024 * 1024 : 0;
    *dynamicSmemSize = per < (size_t)sm.smem_optin ? per : (size_t)sm.smem_optin;
    return CUDA_SUCCESS;
}

/* Thread block clusters (compute capability 9.0 and later): at most 8 blocks portably, 16 when
 * the function allows a non-portable size; a cluster runs on the SMs of one GPC (the simulated
 * devices have GPCs of CLUSTER_GPC_SMS SMs). */
#define CLUSTER_PORTABLE                   8
#define CLUSTER_NONPORTABLE                16
#define CLUSTER_GPC_SMS                    16
#define LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION 4   /* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION */
#define ERROR_INVALID_CLUSTER_SIZE         912 /* CUDA_ERROR_INVALID_CLUSTER_SIZE */

static CUresult cluster_args(CUfunction func, const CUlaunchConfig *config, struct CUfunc_st **f, int *dev, int *blocks,
                             unsigned *size) {
    if (!config) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = resolve(func, f, dev);
    if (rc != CUDA_SUCCESS) return rc;
    const sim_device_cfg *d = &G.cfg->dev[*dev];
    if (d->cc_major < 9) return CUDA_ERROR_NOT_SUPPORTED; /* no clusters before Hopper */
    int threads = (int)(config->blockDimX * config->blockDimY * config->blockDimZ);
    if (threads <= 0 || threads > BLOCK_THREADS || (config->numAttrs && !config->attrs))
        return CUDA_ERROR_INVALID_VALUE;
    *size = 0;
    for (unsigned i = 0; i < config->numAttrs; i++)
        if ((int)config->attrs[i].id == LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
            *size = config->attrs[i].value.clusterDim.x * config->attrs[i].value.clusterDim.y *
                    config->attrs[i].value.clusterDim.z;
    *blocks = blocks_per_sm(*f, *dev, threads, config->sharedMemBytes);
    return CUDA_SUCCESS;
}

static int cluster_limit(const struct CUfunc_st *f) {
    return f->nonportable_cluster ? CLUSTER_NONPORTABLE : CLUSTER_PORTABLE;
}

SIM_EXPORT CUresult cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction func,
                                                       const CUlaunchConfig *config) {
    if (!clusterSize) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *f;
    int dev, blocks;
    unsigned size;
    CUresult rc = cluster_args(func, config, &f, &dev, &blocks, &size);
    if (rc != CUDA_SUCCESS) return rc;
    int per_gpc = blocks * CLUSTER_GPC_SMS, lim = cluster_limit(f);
    *clusterSize = blocks == 0 ? 0 : (per_gpc < lim ? per_gpc : lim);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func, const CUlaunchConfig *config) {
    if (!numClusters) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *f;
    int dev, blocks;
    unsigned size;
    CUresult rc = cluster_args(func, config, &f, &dev, &blocks, &size);
    if (rc != CUDA_SUCCESS) return rc;
    if (size == 0) size = 1;
    if ((int)size > cluster_limit(f)) return (CUresult)ERROR_INVALID_CLUSTER_SIZE;
    int sms = G.cfg->dev[dev].sm_count, gpcs = sms / CLUSTER_GPC_SMS, rest = sms % CLUSTER_GPC_SMS;
    /* whole clusters per GPC (a cluster never spans GPCs), over every GPC */
    *numClusters = gpcs * (blocks * CLUSTER_GPC_SMS / (int)size) + blocks * rest / (int)size;
    return CUDA_SUCCESS;
}

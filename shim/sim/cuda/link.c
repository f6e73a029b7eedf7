/*
 * The driver's JIT linker (cuLinkCreate, cuLinkAddData, cuLinkAddFile, cuLinkComplete,
 * cuLinkDestroy), as numba-cuda and cuda.core use it to link PTX/cubins/libraries into one image.
 * The simulator runs no device code: linking checks the inputs and produces an image that
 * cuModuleLoadData accepts: the PTX inputs concatenated (so their .global variables become module
 * globals), or a small placeholder when there is no PTX. The image lives until cuLinkDestroy.
 */
#include "ctxstack.h"
#include "init.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAGIC_LINK 0x5c7c1111u

struct CUlinkState_st {
    uint32_t magic, gen;
    char *ptx; /* concatenated PTX inputs, NUL-terminated */
    size_t ptx_len;
    size_t inputs;
    int completed;
};

static const char placeholder[] = "// simgpu linked image\n.version 8.0\n.target sm_90\n.address_size 64\n";

SIM_EXPORT CUresult cuLinkCreate_v2(unsigned int numOptions, CUjit_option *options, void **optionValues,
                                    CUlinkState *stateOut) {
    if (!stateOut || (numOptions && (!options || !optionValues))) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    struct CUlinkState_st *l = calloc(1, sizeof *l);
    if (!l) return CUDA_ERROR_OUT_OF_MEMORY;
    l->magic = MAGIC_LINK;
    l->gen = sim_gen();
    *stateOut = l;
    return CUDA_SUCCESS;
}

static CUresult add(CUlinkState state, CUjitInputType type, const void *data, size_t size) {
    if (!SIM_VALID(state, MAGIC_LINK) || state->completed) return CUDA_ERROR_INVALID_HANDLE;
    if ((unsigned)type >= CU_JIT_NUM_INPUT_TYPES || !data || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (type == CU_JIT_INPUT_PTX) {
        size_t n = strnlen(data, size);
        char *p = realloc(state->ptx, state->ptx_len + n + 2);
        if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
        memcpy(p + state->ptx_len, data, n);
        state->ptx_len += n;
        p[state->ptx_len++] = '\n';
        p[state->ptx_len] = 0;
        state->ptx = p;
    }
    state->inputs++;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLinkAddData_v2(CUlinkState state, CUjitInputType type, void *data, size_t size, const char *name,
                                     unsigned int numOptions, CUjit_option *options, void **optionValues) {
    (void)name;
    if (numOptions && (!options || !optionValues)) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    return rc != CUDA_SUCCESS ? rc : add(state, type, data, size);
}

SIM_EXPORT CUresult cuLinkAddFile_v2(CUlinkState state, CUjitInputType type, const char *path, unsigned int numOptions,
                                     CUjit_option *options, void **optionValues) {
    if (!path || (numOptions && (!options || !optionValues))) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    FILE *f = fopen(path, "rb");
    if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            char *nb = cap < (64u << 20) ? realloc(buf, cap = cap ? cap * 2 : 65536) : NULL;
            if (!nb) {
                free(buf);
                fclose(f);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            buf = nb;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        if (r == 0) break;
        len += r;
    }
    fclose(f);
    rc = len ? add(state, type, buf, len) : CUDA_ERROR_INVALID_IMAGE;
    free(buf);
    return rc;
}

SIM_EXPORT CUresult cuLinkComplete(CUlinkState state, void **cubinOut, size_t *sizeOut) {
    if (!cubinOut || !sizeOut) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_VALID(state, MAGIC_LINK)) return CUDA_ERROR_INVALID_HANDLE;
    if (state->inputs == 0) return CUDA_ERROR_INVALID_VALUE; /* nothing to link */
    state->completed = 1;
    if (state->ptx) {
        *cubinOut = state->ptx;
        *sizeOut = state->ptx_len + 1;
    } else {
        *cubinOut = (void *)placeholder;
        *sizeOut = sizeof placeholder;
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLinkDestroy(CUlinkState state) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!SIM_VALID(state, MAGIC_LINK)) return CUDA_ERROR_INVALID_HANDLE;
    state->magic = MAGIC_DEAD;
    free(state->ptx);
    state->ptx = NULL;
    /* the handle itself is kept (never returned to malloc), as for other handles */
    return CUDA_SUCCESS;
}

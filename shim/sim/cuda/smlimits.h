/*
 * Per-SM resource limits of a compute capability (smlimits.c).
 */
#ifndef VGPU_SIM_CUDA_SMLIMITS_H
#define VGPU_SIM_CUDA_SMLIMITS_H

typedef struct {
    int threads, blocks, regs; /* per SM */
    int smem;                  /* shared memory per SM, bytes */
    int smem_optin;            /* shared memory one block may opt in to */
    int smem_reserved;         /* shared memory the system reserves per block */
} sim_sm_limits;
sim_sm_limits sim_sm_limits_of(int cc_major, int cc_minor);

#endif

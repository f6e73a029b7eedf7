/*
 * Per-SM resource limits of a compute capability, as NVIDIA's programming guide tabulates them
 * ("Technical Specifications per Compute Capability"). Device attributes (device.c) and the
 * occupancy calculator (funcattr.c) answer from the same numbers, as the driver does: a client
 * such as cuBLAS sizes its kernels from the attributes and checks them against occupancy.
 */
#include "smlimits.h"

sim_sm_limits sim_sm_limits_of(int cc_major, int cc_minor) {
    /* threads, blocks, registers, shared memory per SM; shared memory per block (opt-in) and
     * reserved per block */
    int cc = cc_major * 10 + cc_minor;
    if (cc < 75) return (sim_sm_limits){2048, 32, 65536, 98304, 98304, 0};
    if (cc == 75) return (sim_sm_limits){1024, 16, 65536, 65536, 65536, 0};
    if (cc == 80 || cc == 87) return (sim_sm_limits){2048, cc == 80 ? 32 : 16, 65536, 167936, 166912, 1024};
    if (cc < 90) /* 8.6, 8.9 */
        return (sim_sm_limits){1536, cc == 89 ? 24 : 16, 65536, 102400, 101376, 1024};
    if (cc >= 120) /* consumer Blackwell */
        return (sim_sm_limits){1536, 32, 65536, 102400, 101376, 1024};
    return (sim_sm_limits){2048, 32, 65536, 233472, 232448, 1024}; /* 9.0, 10.x */
}

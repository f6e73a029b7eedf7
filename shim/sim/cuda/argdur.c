/*
 * Kernels whose duration is one of their arguments: a function named sim_arg<K>ns (K = 0..31)
 * runs, per wave, the number of nanoseconds in its parameter K, read as an unsigned 64-bit
 * integer. This is what a kernel that spins on the GPU's global timer for a time it is given
 * does on hardware (every block spins that long), so a program can ask for a duration at run
 * time without a kernel per duration. Only launches with kernelParams carry it; one packed in
 * `extra` (CU_LAUNCH_PARAM_BUFFER_POINTER) or a graph kernel node keeps the name's default.
 */
#include "argdur.h"

#include "duration.h"
#include "init.h"

#include <string.h>

#define MAX_ARG_KERNEL_NS (10ull * 1000000000ull) /* as any launch: at most 10 s */

int sim_dur_arg_of_name(const char *name) {
    if (!name || strncmp(name, "sim_arg", 7) != 0) return 0;
    const char *p = name + 7;
    int k = 0, digits = 0;
    while (*p >= '0' && *p <= '9' && digits < 2) {
        k = k * 10 + (*p++ - '0');
        digits++;
    }
    if (!digits || k > 31 || strcmp(p, "ns") != 0) return 0;
    return k + 1;
}

uint64_t sim_arg_kernel_ns(const struct CUfunc_st *f, void **params, uint64_t blocks, int dev) {
    const void *arg = params[f->dur_arg - 1];
    if (!arg) return sim_kernel_ns(f, blocks, dev);
    uint64_t per_wave;
    memcpy(&per_wave, arg, sizeof per_wave);
    uint64_t sms = (uint64_t)G.cfg->dev[dev].sm_count;
    uint64_t waves = (blocks + sms - 1) / sms;
    if (per_wave && waves > MAX_ARG_KERNEL_NS / per_wave) return MAX_ARG_KERNEL_NS;
    return per_wave * waves;
}

/*
 * Fat binaries: their container and the cubins inside (fatbin.c).
 */
#ifndef VGPU_SIM_CUDA_FATBIN_H
#define VGPU_SIM_CUDA_FATBIN_H

#include <stddef.h>

const unsigned char *
sim_fatbin_header(const void *image);            /* the container of a fat binary (or its wrapper), else NULL */
size_t sim_fatbin_size(const unsigned char *fb); /* header and entries, in bytes */
unsigned char *sim_fatbin_cubin(const void *image,
                                int sm); /* the ELF cubin for SM `sm` (malloc'ed, NUL-ended), or NULL */

#endif

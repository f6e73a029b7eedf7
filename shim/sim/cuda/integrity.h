/*
 * The integrity digest of NVIDIA's runtime handshake (integrity.c).
 */
#ifndef VGPU_SIM_CUDA_INTEGRITY_H
#define VGPU_SIM_CUDA_INTEGRITY_H

#include <stddef.h>
#include <stdint.h>

void sim_md2(const void *data, size_t len, unsigned char out[16]);
void sim_integrity_digest(uint32_t version, uint64_t unix_seconds, uint32_t driver_version, uint32_t pid,
                          uint32_t thread, const void *cudart_table, const void *integrity_table, const void *check_fn,
                          uint64_t out[2]);

#endif

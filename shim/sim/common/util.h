/*
 * Clocks, sleeping, environment knobs, quantity parsing, one-line diagnostics (util.c).
 */
#ifndef VGPU_SIM_UTIL_H
#define VGPU_SIM_UTIL_H

#include <stddef.h>
#include <stdint.h>

uint64_t sim_now_ns(void);           /* CLOCK_MONOTONIC: one clock for all processes of the node */
uint64_t sim_realtime_us(void);      /* CLOCK_REALTIME in microseconds (NVML sample timestamps) */
void sim_sleep_until_ns(uint64_t t); /* absolute CLOCK_MONOTONIC deadline; never spins */
/* An unsigned integer environment knob; `dflt` when unset. Malformed values print one line and
 * use the default (a knob must not make a program fail). */
uint64_t sim_env_u64(const char *name, uint64_t dflt);
/* Parse a quantity: plain bytes ("1048576"), binary suffixes Ki Mi Gi Ti, decimal K M G T;
 * a decimal fraction is allowed with a suffix ("1.5Gi"). Returns 0 on success. */
int sim_parse_quantity(const char *s, uint64_t *out);
void sim_log(const char *fmt, ...) __attribute__((format(printf, 1, 2))); /* "simgpu: ...\n" */
void sim_copy_str(char *dst, size_t cap, const char *src);                /* truncating, NUL-terminated */

#endif

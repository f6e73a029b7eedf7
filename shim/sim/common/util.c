/* Clocks, sleeping, environment knobs, quantity parsing and diagnostics for the simulator. */
#include "util.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

uint64_t sim_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no syscall, cheap enough for every launch */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t sim_realtime_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000u;
}

void sim_sleep_until_ns(uint64_t t) {
    /* Absolute deadline: an EINTR restart cannot stretch the wait, and there is no spinning. */
    struct timespec ts = {.tv_sec = (time_t)(t / 1000000000ull), .tv_nsec = (long)(t % 1000000000ull)};
    while (sim_now_ns() < t) {
        int rc = clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
        if (rc != 0 && rc != EINTR) break;
    }
}

void sim_log(const char *fmt, ...) {
    /* One write per line so lines of concurrent processes do not interleave. */
    char buf[1024];
    int n = snprintf(buf, sizeof buf, "simgpu: ");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof buf - 2) len = sizeof buf - 2;
    buf[len++] = '\n';
    fwrite(buf, 1, len, stderr);
    fflush(stderr);
}

void sim_copy_str(char *dst, size_t cap, const char *src) {
    if (cap == 0) return;
    size_t n = strlen(src);
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

uint64_t sim_env_u64(const char *name, uint64_t dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    uint64_t out;
    if (sim_parse_quantity(v, &out) != 0) {
        sim_log(
            "environment %s=\"%s\" is not a non-negative integer (a quantity such as 4Mi is also allowed); using %llu",
            name, v, (unsigned long long)dflt);
        return dflt;
    }
    return out;
}

int sim_parse_quantity(const char *s, uint64_t *out) {
    if (!s || !*s) return -1;
    const char *p = s;
    uint64_t whole = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9') {
        unsigned d = (unsigned)(*p - '0');
        if (whole > (UINT64_MAX - d) / 10) return -1;
        whole = whole * 10 + d;
        p++;
        digits++;
    }
    /* optional fraction (only meaningful with a suffix) */
    uint64_t frac_num = 0, frac_den = 1;
    if (*p == '.') {
        p++;
        int fd = 0;
        while (*p >= '0' && *p <= '9') {
            if (frac_den < 1000000000000ull) {
                frac_num = frac_num * 10 + (uint64_t)(*p - '0');
                frac_den *= 10;
            }
            p++;
            fd++;
        }
        if (fd == 0) return -1;
    }
    if (digits == 0) return -1;
    uint64_t mult = 1;
    if (*p) {
        static const struct {
            const char *sfx;
            uint64_t m;
        } sfx[] = {
            {"Ki", 1ull << 10}, {"Mi", 1ull << 20}, {"Gi", 1ull << 30},   {"Ti", 1ull << 40},
            {"K", 1000ull},     {"M", 1000000ull},  {"G", 1000000000ull}, {"T", 1000000000000ull},
        };
        size_t i;
        for (i = 0; i < sizeof sfx / sizeof sfx[0]; i++)
            if (strcmp(p, sfx[i].sfx) == 0) break;
        if (i == sizeof sfx / sizeof sfx[0]) return -1;
        mult = sfx[i].m;
    } else if (frac_den != 1) {
        return -1; /* "1.5" bytes makes no sense */
    }
    if (whole > UINT64_MAX / mult) return -1;
    uint64_t v = whole * mult;
    /* frac_num/frac_den * mult, computed without overflow for the sizes that matter (< 2^64) */
    unsigned __int128 f = (unsigned __int128)frac_num * mult / frac_den;
    if (f > UINT64_MAX - v) return -1;
    *out = v + (uint64_t)f;
    return 0;
}

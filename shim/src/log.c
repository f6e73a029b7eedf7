/* Logging: one "vgpu: ..." line per message on stderr, filtered by LIBCUDA_LOG_LEVEL; the one line
 * that names a bad setting (the configuration's and the limits file's). */
#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

#include "log.h"

static int log_level = VGPU_LOG_WARN;

void vgpu_log_set_level(int level) { log_level = level; }

void vgpu_log(int level, const char *fmt, ...) {
    if (level > log_level && level != VGPU_LOG_CONFIG) return;
    /* Format into one buffer and write(2) it at once: lines from threads and processes sharing
     * the terminal do not interleave, and stdio buffering of the host program is not touched. */
    char buf[512];
    int n = snprintf(buf, sizeof buf, "vgpu: ");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0) return;
    size_t len = (size_t)n + (size_t)m;
    if (len > sizeof buf - 2) len = sizeof buf - 2;
    buf[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, len);
    (void)w; /* nowhere to report a failed write to stderr */
}

void vgpu_format_bytes(uint64_t n, char *buf, size_t len) {
    static const struct {
        const char *unit;
        double size;
    } units[] = {{"TiB", 1099511627776.0}, {"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0}};
    if (n < 1024) {
        snprintf(buf, len, "%llu B", (unsigned long long)n);
        return;
    }
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if ((double)n >= units[i].size) {
            double v = (double)n / units[i].size;
            snprintf(buf, len, v < 10 ? "%.2f %s" : "%.1f %s", v, units[i].unit);
            return;
        }
    }
}

void vgpu_config_error(const char *var, const char *value, const char *why, const char *forms) {
    vgpu_log(VGPU_LOG_CONFIG, "%s=\"%s\" is invalid (%s); accepted: %s", var, value, why, forms);
}

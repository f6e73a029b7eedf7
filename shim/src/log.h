/* Logging (log.c): one "vgpu: ..." line on stderr per message, and the one configuration-error line. */
#ifndef VGPU_LOG_H
#define VGPU_LOG_H

#include <stddef.h>
#include <stdint.h>

enum vgpu_log_level {
    VGPU_LOG_CONFIG = 0, /* configuration errors: always printed, whatever the level */
    VGPU_LOG_ERROR = 1,
    VGPU_LOG_WARN = 2, /* the default */
    VGPU_LOG_INFO = 3,
    VGPU_LOG_DEBUG = 4,
};
/* Print "vgpu: ..." to stderr if level <= LIBCUDA_LOG_LEVEL. */
void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void vgpu_log_set_level(int level);
/* "4.00 GiB", "64.0 MiB", "512 B": the same as sharing.quantity.format_bytes. */
void vgpu_format_bytes(uint64_t n, char *buf, size_t len);
/* Print the one config-error line: "vgpu: VAR=VALUE is invalid: WHY; accepted: FORMS". */
void vgpu_config_error(const char *var, const char *value, const char *why, const char *forms);

#endif

/* Where limit settings come from (settings.c): the plugin's read-only limits file, else the environment. */
#ifndef VGPU_SETTINGS_H
#define VGPU_SETTINGS_H

#include <stdint.h>
#include <sys/stat.h>

/* The plugin's read-only limits file, in the container beside the shim's container path. */
#define VGPU_LIMITS_CONTAINER_PATH "/usr/local/lib/vgpu-sharing/limits"
/* Find the limits file (beside the loaded shim, then VGPU_LIMITS_CONTAINER_PATH): only the plugin's
 * read-only bind mount counts. 0 (with or without one), -1 when one exists but cannot be used or
 * is not the plugin's, or the plugin's mounts are here but not where the shim looks (reported:
 * fail closed). */
int vgpu_settings_load(void);
/* What this process enforces, for its slot of the accounting file (vgpu/region.h, VGPU_LIMITS_*). */
void vgpu_settings_publish(uint32_t *source, uint64_t *dev, uint64_t *ino, uint64_t *hash);
/* A setting's value: from the limits file when one is in force and the name is a limit setting
 * (every one but LIBCUDA_LOG_LEVEL), else from the environment. NULL when unset. */
const char *vgpu_setting(const char *name);
/* The "K=V" entries settings are read from (the limits file's, or environ). */
char **vgpu_setting_entries(void);
const char *vgpu_settings_file(void); /* the limits file in force, or NULL */
int vgpu_setting_is_controlled(const char *name);
/* Whether the open file (st: its fstat) is the root of a read-only mount of its own, as the plugin
 * mounts its files: 1 yes, 0 no, -1 cannot tell (*why says why not, for 0 and -1). */
int vgpu_plugin_mount(int fd, const struct stat *st, const char **why);
/* Log once where the limits come from and which environment settings were ignored. */
void vgpu_settings_report(void);

#endif

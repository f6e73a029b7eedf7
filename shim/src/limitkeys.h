/* The limits file's entries checked against vgpu/limits.def. Compiled into the shim (settings.c
 * calls it before any setting is read from the file) and into the Python binding
 * (sharing/limitsfile.py), so the plugin's writer and the shim refuse exactly the same files. */
#ifndef VGPU_LIMITKEYS_H
#define VGPU_LIMITKEYS_H

#include <stddef.h>

/* entries: NULL-terminated "KEY=VALUE" strings, the file's lines without their leading and
 * trailing blanks, blank lines and comments. 0 when every entry is valid and the file complete,
 * else -1 with a one-line reason in why (naming the key and what is allowed). */
int vgpu_limits_check(char **entries, char *why, size_t len);

#endif

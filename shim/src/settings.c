/*
 * Where the limit settings come from.
 *
 * Under the DRA driver the plugin writes the claim's limits into a file that it mounts read-only
 * beside the shim (VGPU_LIMITS_CONTAINER_PATH). When that file exists it is the only source of
 * every limit-related setting: the container's environment is the tenant's, and a tenant must not
 * be able to lift its own limits (CUDA_DISABLE_CONTROL=1, VGPU_COMPUTE_POLICY=off, an unset or
 * larger CUDA_DEVICE_MEMORY_LIMIT...). Without the file (`vgpu run`, a plain LD_PRELOAD), the
 * environment is the source, as in HAMi-core.
 *
 * The file is looked for beside the loaded shim first (so a test or an admin can ship a copy of the
 * shim with its limits), then at the fixed container path. Its format is the environment's:
 * KEY=VALUE lines, '#' comments; the parsers of config.c and compute.c read its entries exactly as
 * they read the environment's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shim_internal.h"

extern char **environ;

#define LIMITS_MAX_BYTES 65536
#define LIMITS_MAX_ENTRIES 256

static char **file_entries;      /* NULL-terminated "K=V" strings of the limits file, or NULL */
static char file_path[4096];     /* the limits file in force, "" when none */

/* Names whose value a tenant could use to lift a limit: with a limits file they come from the file
 * only. LIBCUDA_LOG_LEVEL (and CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER: which devices, not how
 * much) stay the environment's. */
static const char *const controlled_prefixes[] = {
    "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_MEMORY_SHARED_CACHE",
    "CUDA_DISABLE_CONTROL",     "CUDA_TASK_PRIORITY",   "GPU_CORE_UTILIZATION_POLICY",
    "VGPU_",
};

int vgpu_setting_is_controlled(const char *name) {
    for (size_t i = 0; i < sizeof controlled_prefixes / sizeof controlled_prefixes[0]; i++)
        if (strncmp(name, controlled_prefixes[i], strlen(controlled_prefixes[i])) == 0) return 1;
    return 0;
}

static int key_char(char c) { return (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

/* Parse the file's text into entries. 0, or -1 after the one config-error line. */
static int parse_file(const char *path, char *text) {
    size_t cap = 16, n = 0;
    char **out = calloc(cap + 1, sizeof *out);
    if (out == NULL) return -1;
    int lineno = 0;
    for (char *line = text; line != NULL && *line != '\0';) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        lineno++;
        char *s = line;
        line = nl ? nl + 1 : NULL;
        size_t len = strlen(s);
        while (len > 0 && (s[len - 1] == '\r' || s[len - 1] == ' ' || s[len - 1] == '\t')) s[--len] = '\0';
        while (*s == ' ' || *s == '\t') s++;
        if (*s == '\0' || *s == '#') continue;
        char *eq = strchr(s, '=');
        int ok = eq != NULL && eq != s;
        for (char *k = s; ok && k < eq; k++) ok = key_char(*k);
        if (!ok || n >= LIMITS_MAX_ENTRIES) {
            char where[64];
            snprintf(where, sizeof where, "line %d", lineno);
            vgpu_config_error(path, where, n >= LIMITS_MAX_ENTRIES ? "too many entries" : "not a KEY=VALUE line",
                              "KEY=VALUE lines with KEY in [A-Z0-9_], blank lines and # comments");
            free(out);
            return -1;
        }
        if (n == cap) {
            char **more = realloc(out, (2 * cap + 1) * sizeof *out);
            if (more == NULL) { free(out); return -1; }
            out = more;
            cap *= 2;
        }
        out[n++] = s;
    }
    out[n] = NULL;
    file_entries = out;
    return 0;
}

/* 1: the file at `path` is in force (parsed); 0: there is none; -1: it exists but is unusable
 * (reported: the process fails closed, it must not fall back to the tenant's environment). */
static int try_file(const char *path) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR) return 0;
        vgpu_config_error(path, "(limits file)", strerror(errno), "a regular file the plugin wrote, readable");
        return -1;
    }
    struct stat st;
    if (vgpu_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > LIMITS_MAX_BYTES) {
        close(fd);
        vgpu_config_error(path, "(limits file)", "not a regular file of at most 64 KiB",
                          "a regular file the plugin wrote, readable");
        return -1;
    }
    char *text = malloc((size_t)st.st_size + 1);
    ssize_t got = text ? read(fd, text, (size_t)st.st_size) : -1;
    int err = errno;
    close(fd);
    if (got < 0 || got != st.st_size) {
        free(text);
        vgpu_config_error(path, "(limits file)", got < 0 ? strerror(err) : "short read",
                          "a regular file the plugin wrote, readable");
        return -1;
    }
    text[(size_t)got] = '\0'; /* kept for the life of the process: the entries point into it */
    if (parse_file(path, text) != 0) {
        free(text);
        return -1;
    }
    snprintf(file_path, sizeof file_path, "%s", path);
    /* Root can write any file not on a read-only mount: the plugin mounts it read-only, and a
     * tenant's root cannot remount it. What is worth a line is a file others may write. */
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) || (geteuid() != 0 && faccessat(AT_FDCWD, path, W_OK, AT_EACCESS) == 0))
        vgpu_log(VGPU_LOG_WARN, "limits file %s is writable by this process: the plugin should mount it read-only",
                 path);
    return 1;
}

int vgpu_settings_load(void) {
    file_entries = NULL;
    file_path[0] = '\0';
    Dl_info info;
    if (dladdr((void *)vgpu_settings_load, &info) != 0 && info.dli_fname != NULL) {
        const char *slash = strrchr(info.dli_fname, '/');
        if (slash != NULL && (size_t)(slash - info.dli_fname) + sizeof "/limits" < sizeof file_path) {
            char beside[sizeof file_path];
            snprintf(beside, sizeof beside, "%.*s/limits", (int)(slash - info.dli_fname), info.dli_fname);
            int rc = try_file(beside);
            if (rc != 0) return rc < 0 ? -1 : 0;
        }
    }
    return try_file(VGPU_LIMITS_CONTAINER_PATH) < 0 ? -1 : 0;
}

const char *vgpu_settings_file(void) { return file_path[0] ? file_path : NULL; }

char **vgpu_setting_entries(void) { return file_entries ? file_entries : environ; }

const char *vgpu_setting(const char *name) {
    if (file_entries == NULL || !vgpu_setting_is_controlled(name)) return getenv(name);
    size_t len = strlen(name);
    const char *found = NULL;
    for (char **e = file_entries; *e != NULL; e++)
        if (strncmp(*e, name, len) == 0 && (*e)[len] == '=') found = *e + len + 1; /* the last one wins */
    return found;
}

void vgpu_settings_report(void) {
    if (file_entries == NULL) return;
    char ignored[400];
    size_t n = 0;
    ignored[0] = '\0';
    for (char **e = environ; e != NULL && *e != NULL; e++) {
        const char *eq = strchr(*e, '=');
        if (eq == NULL) continue;
        char name[96];
        size_t len = (size_t)(eq - *e) < sizeof name - 1 ? (size_t)(eq - *e) : sizeof name - 1;
        memcpy(name, *e, len);
        name[len] = '\0';
        if (!vgpu_setting_is_controlled(name)) continue;
        int w = snprintf(ignored + n, sizeof ignored - n, "%s%s", n ? ", " : "", name);
        if (w < 0 || (size_t)w >= sizeof ignored - n) break;
        n += (size_t)w;
    }
    if (n > 0)
        vgpu_log(VGPU_LOG_WARN, "limits come from %s; ignoring the environment's %s", file_path, ignored);
    else
        vgpu_log(VGPU_LOG_INFO, "limits come from %s", file_path);
}

/*
 * Where the limit settings come from.
 *
 * Under the DRA driver the plugin writes the claim's limits into a file that it bind-mounts
 * read-only beside the shim (VGPU_LIMITS_CONTAINER_PATH). That file is the only source of every
 * limit-related setting: the container's environment is the tenant's, and a tenant must not be
 * able to lift its own limits (CUDA_DISABLE_CONTROL=1, VGPU_COMPUTE_POLICY=off, an unset or larger
 * CUDA_DEVICE_MEMORY_LIMIT...). Without it (`vgpu run`, a plain LD_PRELOAD), the environment is the
 * source, as in HAMi-core.
 *
 * The tenant may be root in its container: it can write any file it can open and rename any
 * directory that is not itself a mount point (so it can move the directory holding the plugin's
 * mounts aside and put a copy of the shim and a limits file of its own in its place). So a limits
 * file counts only if it is the plugin's: the root of a read-only mount of its own (fstatvfs says
 * read-only, and statx says it is a mount's root; on kernels before 5.8, /proc/self/mountinfo has
 * a mount point that is this very file). A file named
 * `limits` beside the loaded shim or at the container path that is not such a mount is a forgery:
 * the process fails closed. And where the plugin's mounts are in this mount namespace (a
 * read-only `libvgpu.so` and `limits` mounted side by side: a mount point cannot be renamed, so
 * the pair stays together wherever its directory is moved) but no plugin file was found at the
 * places the shim looks, the claim is enforced and its file is gone from there: fail closed too.
 * A process that loads no shim at all, or a tampered copy, is the watchdog's (docs/shim.md).
 *
 * The file's format is the environment's: KEY=VALUE lines, '#' comments; the parsers of config.c
 * and compute.c read its entries exactly as they read the environment's. What the process
 * enforces, and from where, is published in its slot of the accounting file (region.h).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "limitkeys.h"
#include "settings.h"
#include "vgpu/region.h"
#include "log.h"
#include "shim_internal.h"

extern char **environ;

#define LIMITS_MAX_BYTES   65536
#define LIMITS_MAX_ENTRIES 256

static char **file_entries;   /* NULL-terminated "K=V" strings of the limits file, or NULL */
static char file_path[4096];  /* the limits file in force, "" when none */
static struct stat file_stat; /* its identity, for the accounting file (vgpu_settings_publish) */
static uint64_t file_hash;    /* FNV-1a 64 of its bytes */

/* Names whose value a tenant could use to lift a limit: with a limits file they come from the file
 * only. LIBCUDA_LOG_LEVEL (and CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER: which devices, not how
 * much) stay the environment's. */
static const char *const controlled_prefixes[] = {
    "CUDA_DEVICE_MEMORY_LIMIT",
    "CUDA_DEVICE_SM_LIMIT",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
    "CUDA_DISABLE_CONTROL",
    "CUDA_TASK_PRIORITY",
    "GPU_CORE_UTILIZATION_POLICY",
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
            if (more == NULL) {
                free(out);
                return -1;
            }
            out = more;
            cap *= 2;
        }
        out[n++] = s;
    }
    out[n] = NULL;
    file_entries = out;
    return 0;
}

/* ---- /proc/self/mountinfo ---- */

/* Undo mountinfo's octal escapes (\040 space, \011 tab, \012 newline, \134 backslash) in place. */
static void unescape(char *s) {
    char *o = s;
    for (; *s; s++) {
        if (s[0] == '\\' && s[1] >= '0' && s[1] <= '3' && s[2] >= '0' && s[2] <= '7' && s[3] >= '0' && s[3] <= '7') {
            *o++ = (char)((s[1] - '0') * 64 + (s[2] - '0') * 8 + (s[3] - '0'));
            s += 3;
        } else {
            *o++ = *s;
        }
    }
    *o = '\0';
}

/* One mount: its mount point (unescaped) and whether it is read-only (per-mount options). */
typedef int (*mount_visitor)(const char *point, int ro, void *arg);

/* /proc/self/mountinfo's text (NUL-terminated, malloc'ed), or NULL. One read() loop: stdio
 * would cost a process start more than the parsing. */
static char *read_mountinfo(void) {
    int fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NULL;
    size_t cap = 8192, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (buf == NULL) break;
        if (len + 1 >= cap) {
            char *more = cap < (1u << 24) ? realloc(buf, cap * 2) : NULL;
            if (more == NULL) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = more;
            cap *= 2;
        }
        ssize_t got = read(fd, buf + len, cap - 1 - len);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            free(buf);
            buf = NULL;
            break;
        }
        if (got == 0) {
            buf[len] = '\0';
            break;
        }
        len += (size_t)got;
    }
    close(fd);
    return buf;
}

/* Calls visit for each mount of the mountinfo text (consumed) until it returns non-zero; that
 * value, or 0 after the last. */
static int each_mount_in(char *text, mount_visitor visit, void *arg) {
    int rc = 0;
    for (char *line = text; rc == 0 && line != NULL && *line != '\0';) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        char *next = nl ? nl + 1 : NULL;
        /* ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS ... */
        char *save = NULL, *field[6];
        int n = 0;
        for (char *t = strtok_r(line, " ", &save); t != NULL && n < 6; t = strtok_r(NULL, " ", &save)) field[n++] = t;
        line = next;
        if (n < 6) continue;
        unescape(field[4]);
        int ro = strcmp(field[5], "ro") == 0 || strncmp(field[5], "ro,", 3) == 0;
        rc = visit(field[4], ro, arg);
    }
    return rc;
}

/* The same over this process's mounts; -1 when mountinfo cannot be read. */
static int each_mount(mount_visitor visit, void *arg) {
    char *text = read_mountinfo();
    if (text == NULL) return -1;
    int rc = each_mount_in(text, visit, arg);
    free(text);
    return rc;
}

struct same_file {
    const struct stat *st;
};

static int is_mount_of(const char *point, int ro, void *arg) {
    const struct stat *want = ((struct same_file *)arg)->st;
    if (!ro) return 0;
    /* open + fstat: stat() is a GLIBC_2.33 symbol (the shim loads into glibc from 2.17) */
    int fd = open(point, O_PATH | O_CLOEXEC);
    if (fd < 0) return 0;
    struct stat st;
    int same = vgpu_fstat(fd, &st) == 0 && st.st_dev == want->st_dev && st.st_ino == want->st_ino;
    close(fd);
    return same;
}

/* Whether statx says the open file is the root of a mount (Linux 5.8): 1 yes, 0 no, -1 the
 * kernel does not say. Through syscall(): glibc's statx is a 2.28 symbol. */
static int mount_root(int fd) {
#if defined(SYS_statx) && defined(STATX_ATTR_MOUNT_ROOT)
    struct statx sx;
    memset(&sx, 0, sizeof sx);
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_BASIC_STATS, &sx) == 0 &&
        (sx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT))
        return (sx.stx_attributes & STATX_ATTR_MOUNT_ROOT) != 0;
#else
    (void)fd;
#endif
    return -1;
}

/* Whether the open file (st: its fstat) is the root of a read-only mount of its own (a bind
 * mount the plugin made): 1 yes, 0 no (*why says which part fails), -1 cannot tell (*why). A
 * regular file that is a mount's root was reached through its own mount point, so statx's word
 * is enough; kernels before 5.8 do not give it, and there /proc/self/mountinfo must have a
 * read-only mount point that is this very file (reading it costs 50-300 us, with the node's
 * mounts). */
static int own_ro_mount(int fd, const struct stat *st, const char **why) {
    struct statvfs vs;
    if (fstatvfs(fd, &vs) != 0) {
        *why = strerror(errno);
        return -1;
    }
    if (!(vs.f_flag & ST_RDONLY)) {
        *why = "it is on a writable file system";
        return 0;
    }
    const char *copy = "it is not a read-only mount of its own (a copy, not the plugin's bind mount)";
    int root = mount_root(fd);
    if (root >= 0) {
        if (root == 0) *why = copy;
        return root;
    }
    struct same_file sf = {st};
    int rc = each_mount(is_mount_of, &sf);
    if (rc < 0) {
        *why = "/proc/self/mountinfo is unreadable, so it cannot be told from a copy";
        return -1;
    }
    if (rc == 0) *why = copy;
    return rc > 0;
}

int vgpu_plugin_mount(int fd, const struct stat *st, const char **why) { return own_ro_mount(fd, st, why); }

/* The plugin's pair of mounts: read-only mount points D/libvgpu.so and D/limits. */
struct pair_search {
    char shims[8][512]; /* directories of read-only mount points named libvgpu.so */
    int nshims;
    char found[512]; /* D/limits of the first pair */
};

static int split_dir(const char *point, const char *name, char *dir, size_t cap) {
    const char *slash = strrchr(point, '/');
    if (slash == NULL || strcmp(slash + 1, name) != 0 || (size_t)(slash - point) >= cap) return 0;
    memcpy(dir, point, (size_t)(slash - point));
    dir[slash - point] = '\0';
    return 1;
}

static int collect_shims(const char *point, int ro, void *arg) {
    struct pair_search *ps = arg;
    if (ro && ps->nshims < 8 && split_dir(point, "libvgpu.so", ps->shims[ps->nshims], sizeof ps->shims[0]))
        ps->nshims++;
    return 0;
}

static int match_limits(const char *point, int ro, void *arg) {
    struct pair_search *ps = arg;
    char dir[512];
    if (!ro || !split_dir(point, "limits", dir, sizeof dir)) return 0;
    for (int i = 0; i < ps->nshims; i++)
        if (strcmp(ps->shims[i], dir) == 0) {
            snprintf(ps->found, sizeof ps->found, "%s", point);
            return 1;
        }
    return 0;
}

/* The plugin's limits mount in this mount namespace, wherever its directory was moved: 1 (path in
 * out), 0 none, -1 mountinfo unreadable. */
static int plugin_limits_mount(char *out, size_t cap) {
    char *text = read_mountinfo();
    if (text == NULL) return -1;
    int rc = 0;
    /* the common case, no plugin mounts at all (`vgpu run`): a search, no parsing */
    if (strstr(text, "/libvgpu.so ") != NULL && strstr(text, "/limits ") != NULL) {
        struct pair_search ps;
        memset(&ps, 0, sizeof ps);
        size_t len = strlen(text);
        char *copy = malloc(len + 1); /* parsing consumes the text: one copy per pass */
        if (copy == NULL) {
            free(text);
            return -1;
        }
        memcpy(copy, text, len + 1);
        each_mount_in(text, collect_shims, &ps);
        if (ps.nshims > 0) rc = each_mount_in(copy, match_limits, &ps);
        if (rc > 0) snprintf(out, cap, "%s", ps.found);
        free(copy);
    }
    free(text);
    return rc;
}

/* ---- the limits file ---- */

static const char plugin_forms[] =
    "the plugin's read-only bind mount at " VGPU_LIMITS_CONTAINER_PATH " (or beside the plugin's mounted libvgpu.so)";

/* 1: the file at `path` is in force (parsed); 0: there is none; -1: it exists but is unusable or
 * not the plugin's (reported: the process fails closed, it must not fall back to the tenant's
 * environment). */
static int try_file(const char *path) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR) return 0;
        vgpu_config_error(path, "(limits file)", strerror(errno), plugin_forms);
        return -1;
    }
    struct stat st;
    if (vgpu_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > LIMITS_MAX_BYTES) {
        close(fd);
        vgpu_config_error(path, "(limits file)", "not a regular file of at most 64 KiB", plugin_forms);
        return -1;
    }
    const char *why = NULL;
    if (own_ro_mount(fd, &st, &why) != 1) {
        close(fd);
        char what[160];
        snprintf(what, sizeof what, "not the plugin's: %s", why);
        vgpu_config_error(path, "(limits file)", what, plugin_forms);
        return -1;
    }
    char *text = malloc((size_t)st.st_size + 1);
    ssize_t got = text ? read(fd, text, (size_t)st.st_size) : -1;
    int err = errno;
    close(fd);
    if (got < 0 || got != st.st_size) {
        free(text);
        vgpu_config_error(path, "(limits file)", got < 0 ? strerror(err) : "short read", plugin_forms);
        return -1;
    }
    text[(size_t)got] = '\0';           /* kept for the life of the process: the entries point into it */
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a 64, of the bytes before parsing writes into them */
    for (ssize_t i = 0; i < got; i++) h = (h ^ (unsigned char)text[i]) * 0x100000001b3ULL;
    if (memchr(text, '\0', (size_t)got) != NULL) {
        free(text);
        vgpu_config_error(path, "(limits file)", "a NUL byte", "the keys and forms of vgpu/limits.def");
        return -1;
    }
    if (parse_file(path, text) != 0) {
        free(text);
        return -1;
    }
    char bad[1024];
    if (vgpu_limits_check(file_entries, bad, sizeof bad) != 0) {
        vgpu_config_error(path, "(limits file)", bad, "the keys and forms of vgpu/limits.def");
        free(file_entries);
        file_entries = NULL;
        free(text);
        return -1;
    }
    snprintf(file_path, sizeof file_path, "%s", path);
    file_stat = st;
    file_hash = h;
    return 1;
}

int vgpu_settings_load(void) {
    file_entries = NULL;
    file_path[0] = '\0';
    Dl_info info;
    const char *shim = NULL;
    if (dladdr((void *)vgpu_settings_load, &info) != 0 && info.dli_fname != NULL) {
        shim = info.dli_fname;
        const char *slash = strrchr(shim, '/');
        if (slash != NULL && (size_t)(slash - shim) + sizeof "/limits" < sizeof file_path) {
            char beside[sizeof file_path];
            snprintf(beside, sizeof beside, "%.*s/limits", (int)(slash - shim), shim);
            int rc = try_file(beside);
            if (rc != 0) return rc < 0 ? -1 : 0;
        }
    }
    int rc = try_file(VGPU_LIMITS_CONTAINER_PATH);
    if (rc != 0) return rc < 0 ? -1 : 0;
    /* No file where the shim looks. If the plugin's mounts are here, its file was moved away
     * from the shim that runs (a copy, or the shim's directory renamed): fail closed. */
    char moved[512];
    if (plugin_limits_mount(moved, sizeof moved) == 1) {
        char what[700];
        snprintf(what, sizeof what, "the plugin's limits are mounted at %s, not beside this shim (%s)", moved,
                 shim ? shim : "?");
        vgpu_config_error(VGPU_LIMITS_CONTAINER_PATH, "(missing)", what,
                          "the plugin's libvgpu.so and limits where the plugin mounted them (do not move them)");
        return -1;
    }
    return 0;
}

void vgpu_settings_publish(uint32_t *source, uint64_t *dev, uint64_t *ino, uint64_t *hash) {
    *source = file_entries != NULL ? VGPU_LIMITS_FILE : VGPU_LIMITS_ENV;
    *dev = file_entries != NULL ? (uint64_t)file_stat.st_dev : 0;
    *ino = file_entries != NULL ? (uint64_t)file_stat.st_ino : 0;
    *hash = file_entries != NULL ? file_hash : 0;
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
        /* the plugin's CDI spec sets some of these to the file's own values (for tools that read
         * them): a value the file agrees with is not ignored, and not worth a warning */
        const char *in_file = vgpu_setting(name);
        if (in_file != NULL && strcmp(in_file, eq + 1) == 0) continue;
        int w = snprintf(ignored + n, sizeof ignored - n, "%s%s", n ? ", " : "", name);
        if (w < 0 || (size_t)w >= sizeof ignored - n) break;
        n += (size_t)w;
    }
    if (n > 0)
        vgpu_log(VGPU_LOG_WARN, "limits come from %s; ignoring the environment's %s", file_path, ignored);
    else
        vgpu_log(VGPU_LOG_INFO, "limits come from %s", file_path);
}

/*
 * Bursting: the second bound. A slice's request is its memory limit (CUDA_DEVICE_MEMORY_LIMIT_<i>);
 * above it the slice may use only what the plugin granted it out of the device's pool, read from
 * the plugin's pool file (layout and protocol: vgpu/region.h; the entry's reads: pool_io.c) at
 * every charge that needs it. The file is mapped read-only; under the plugin's limits file it must
 * be the plugin's read-only bind mount of its own (as the limits file must), so no tenant can write
 * its own grant or anyone else's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "burst.h"
#include "config.h"
#include "log.h"
#include "pool_io.h"
#include "safefile.h"
#include "settings.h"
#include "shim_internal.h"

static const struct vgpu_pool *P; /* the read-only mapping, NULL when no device bursts */

static const char pool_forms[] = "the plugin's pool file, mounted read-only (VGPU_BURST_POOL)";

/* The pool file, never through a link, except where the settings are the environment's and the
 * link is /proc/<pid>/fd/<n> (`vgpu run`'s pool is a memfd CMD inherits): a kernel link nobody can
 * plant, the one the accounting file follows too (region.c). -1 with errno. */
static int open_pool(const char *path) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0 || errno != ELOOP || vgpu_settings_file() != NULL) return fd;
    char dir[4096];
    const char *slash = strrchr(path, '/');
    size_t n = slash != NULL ? (size_t)(slash - path) : 0;
    struct statfs sfs;
    int dfd = -1;
    if (n > 0 && n < sizeof dir) {
        memcpy(dir, path, n);
        dir[n] = '\0';
        dfd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    }
    if (dfd >= 0 && fstatfs(dfd, &sfs) == 0 && sfs.f_type == PROC_SUPER_MAGIC)
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    else
        errno = ELOOP;
    if (dfd >= 0) close(dfd);
    return fd;
}

int vgpu_burst_open(void) {
    const struct vgpu_config *cfg = vgpu_config();
    if (!cfg->any_burst) return 0;
    const char *path = cfg->burst_pool;
    char why[160] = "";
    const char *w = NULL;
    void *m = MAP_FAILED;
    int fd = open_pool(path);
    struct stat st;
    if (fd < 0)
        snprintf(why, sizeof why, "%s", vgpu_open_error(errno));
    else if (vgpu_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        snprintf(why, sizeof why, "not a regular file");
    /* under the plugin's limits file the pool must be the plugin's too; from the environment
     * (`vgpu run`) the tenant chose both, and the file only has to be a pool file */
    else if (vgpu_settings_file() != NULL && vgpu_plugin_mount(fd, &st, &w) != 1)
        snprintf(why, sizeof why, "not the plugin's: %s", w);
    else if ((uint64_t)st.st_size != sizeof(struct vgpu_pool))
        snprintf(why, sizeof why, "size %lld bytes, expected %zu (pool layout %d)", (long long)st.st_size,
                 sizeof(struct vgpu_pool), VGPU_POOL_LAYOUT_VERSION);
    else if ((m = mmap(NULL, sizeof(struct vgpu_pool), PROT_READ, MAP_SHARED, fd, 0)) == MAP_FAILED)
        snprintf(why, sizeof why, "cannot map: %s", strerror(errno));
    else
        vgpu_pool_check(m, sizeof(struct vgpu_pool), why, sizeof why);
    if (why[0] != '\0' && m != MAP_FAILED) munmap(m, sizeof(struct vgpu_pool));
    if (why[0] == '\0') P = m;
    if (fd >= 0) close(fd);
    if (why[0] != '\0') vgpu_config_error(path, "(burst pool file)", why, pool_forms);
    return why[0] != '\0' ? -1 : 0;
}

int vgpu_burst_on(int dev) {
    const struct vgpu_config *cfg = vgpu_config();
    return P != NULL && cfg->burst_limit[dev] > cfg->limit[dev];
}

uint64_t vgpu_burst_limit(int dev) { return vgpu_config()->burst_limit[dev]; }

uint64_t vgpu_burst_bound(int dev) {
    const struct vgpu_config *cfg = vgpu_config();
    uint64_t request = cfg->limit[dev];
    if (!vgpu_burst_on(dev)) return request;
    struct vgpu_pool_grant g;
    uint64_t grant = 0;
    if (vgpu_pool_grant_read(&P->grants[cfg->burst_entry[dev]], &g) == 0 && g.key == cfg->burst_key[dev] &&
        g.state != VGPU_GRANT_FREE)
        grant = g.grant;
    uint64_t headroom = cfg->burst_limit[dev] - request;
    return request + (grant < headroom ? grant : headroom);
}

/*
 * Elastic demand records (layout: vgpu/compute_state.h, struct vgpu_demand_file; rules:
 * docs/compute.md). Each slice writes only its own file; an elastic slice reads the others'.
 *
 *  - Under the DRA driver the plugin creates the claim's file empty and mounts it writable at
 *    VGPU_DEMAND_FILE, and mounts the node-state directory (every claim's file) read-only at
 *    VGPU_NODE_STATE_DIR: a tenant can write its own record and nobody else's.
 *  - Without it (`vgpu run`) each slice creates <dir>/<slice id>.demand in a directory of its
 *    own user (default $XDG_RUNTIME_DIR/vgpu-node, else /tmp/vgpu-node-<uid>), refused when the
 *    directory is a link, belongs to someone else, or others may write it without the sticky bit.
 *  - Another slice's file is never mapped (its writer could truncate it and kill the reader with
 *    SIGBUS): it is read with pread() into a copy, and the copy is judged by vc_peer_demand().
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "compute_controller.h"
#include "demand.h"
#include "log.h"
#include "safefile.h"
#include "vgpu/region.h"
#include "shim_internal.h"

#define MAX_PEERS    64
#define SCAN_NS      (250 * 1000000LL) /* re-list the directory at most this often */
#define STALE_FILE_S 3600              /* vgpu run: another slice's file untouched this long is removed */

static char g_dir[512];      /* "" = no node state */
static char g_own_path[512]; /* VGPU_DEMAND_FILE, "" = create <dir>/<id>.demand */
static int g_default_dir;    /* the default directory: this user's own, never a link */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_dfd = -1;                                   /* the checked directory (-1: not opened yet; -2: unusable) */
static int g_dir_shared;                                 /* others may write it (sticky) */
static struct vgpu_demand_file *g_own[VGPU_MAX_DEVICES]; /* mapped own file per device index */
static dev_t g_own_dev[VGPU_MAX_DEVICES];
static ino_t g_own_ino[VGPU_MAX_DEVICES];
static int g_peer_fd[MAX_PEERS];
static int g_npeers;
static int64_t g_next_scan;

int vgpu_demand_configure(const char *dir, const char *own_path, int default_dir) {
    snprintf(g_dir, sizeof g_dir, "%s", dir ? dir : "");
    snprintf(g_own_path, sizeof g_own_path, "%s", own_path ? own_path : "");
    g_default_dir = default_dir;
    return 0;
}

const char *vgpu_demand_dir(void) { return g_dir[0] ? g_dir : "(none)"; }

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* g_mu held. The node-state directory's descriptor, opened and checked once; -1 if unusable. */
static int dir_fd(void) {
    if (g_dfd != -1) return g_dfd >= 0 ? g_dfd : -1;
    g_dfd = -2;
    if (!g_dir[0]) return -1;
    char why[200];
    int fd;
    /* Slices that create their own files create the directory too (for this user only). */
    if (!g_own_path[0] && mkdir(g_dir, 0700) != 0 && errno != EEXIST) {
        vgpu_log(VGPU_LOG_INFO, "compute cap: cannot create node state %s: %s", g_dir, strerror(errno));
        return -1;
    }
    if (g_default_dir) {
        /* Ours; never through a link someone planted in its place. */
        fd = open(g_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) {
            vgpu_log(VGPU_LOG_WARN, "compute cap: node state %s refused: %s", g_dir,
                     errno == ELOOP || errno == ENOTDIR ? "not a directory (a link?)" : strerror(errno));
            return -1;
        }
        struct stat st;
        if (vgpu_fstat(fd, &st) != 0 || st.st_uid != geteuid()) {
            vgpu_log(VGPU_LOG_WARN, "compute cap: node state %s refused: it belongs to uid %u, not this user", g_dir,
                     (unsigned)st.st_uid);
            close(fd);
            return -1;
        }
    } else {
        fd = open(g_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0) {
            vgpu_log(VGPU_LOG_INFO, "compute cap: cannot open node state %s: %s", g_dir, strerror(errno));
            return -1;
        }
    }
    if (vgpu_dir_check(fd, &g_dir_shared, why, sizeof why) != 0) {
        vgpu_log(VGPU_LOG_WARN, "compute cap: node state %s refused: %s", g_dir, why);
        close(fd);
        return -1;
    }
    g_dfd = fd;
    return fd;
}

/* g_mu held. Map the own file for device index dev: VGPU_DEMAND_FILE, or <dir>/<id>.demand. */
static struct vgpu_demand_file *map_own(int dev, uint64_t slice_id) {
    char why[200];
    int fd;
    const char *shown = g_own_path;
    char name[64];
    if (g_own_path[0]) {
        fd = open(g_own_path, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC); /* the plugin created it */
        if (fd < 0) {
            vgpu_log(VGPU_LOG_WARN, "compute cap: demand file %s: %s", g_own_path, vgpu_open_error(errno));
            return NULL;
        }
        if (vgpu_file_check(fd, 0, why, sizeof why) != 0) {
            vgpu_log(VGPU_LOG_WARN, "compute cap: demand file %s %s", g_own_path, why);
            close(fd);
            return NULL;
        }
    } else {
        int dfd = dir_fd();
        if (dfd < 0) return NULL;
        snprintf(name, sizeof name, "%016llx.demand", (unsigned long long)slice_id);
        shown = name;
        fd = openat(dfd, name, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
        if (fd < 0) {
            vgpu_log(VGPU_LOG_WARN, "compute cap: demand file %s/%s: %s", g_dir, name, vgpu_open_error(errno));
            return NULL;
        }
        if (vgpu_file_check(fd, g_dir_shared, why, sizeof why) != 0) {
            vgpu_log(VGPU_LOG_WARN, "compute cap: demand file %s/%s %s", g_dir, name, why);
            close(fd);
            return NULL;
        }
    }
    struct stat st;
    /* Growing to the exact size by racing processes of the slice is harmless. */
    if (vgpu_fstat(fd, &st) != 0 ||
        (st.st_size < (off_t)sizeof(struct vgpu_demand_file) && ftruncate(fd, sizeof(struct vgpu_demand_file)) != 0)) {
        vgpu_log(VGPU_LOG_WARN, "compute cap: demand file %s: cannot size it: %s", shown, strerror(errno));
        close(fd);
        return NULL;
    }
    void *m = mmap(NULL, sizeof(struct vgpu_demand_file), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return NULL;
    struct vgpu_demand_file *f = m;
    uint32_t zero = 0;
    if (__atomic_compare_exchange_n(&f->magic, &zero, VGPU_DEMAND_MAGIC, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        f->version = VGPU_DEMAND_VERSION;
        f->ndev = VGPU_DEMAND_DEVICES;
    } else if (zero != VGPU_DEMAND_MAGIC) {
        vgpu_log(VGPU_LOG_WARN, "compute cap: %s is not a demand file", shown);
        munmap(m, sizeof *f);
        return NULL;
    }
    g_own_dev[dev] = st.st_dev;
    g_own_ino[dev] = st.st_ino;
    return f;
}

struct vgpu_node_slot *vgpu_demand_own(int dev, const uint8_t uuid[16], uint64_t slice_id, uint32_t cap_permille,
                                       uint32_t policy, int32_t priority) {
    if (dev < 0 || dev >= VGPU_MAX_DEVICES || !g_dir[0]) return NULL;
    pthread_mutex_lock(&g_mu);
    struct vgpu_demand_file *f = g_own[dev];
    if (f == NULL) {
        int from = -1; /* under the plugin one file holds every device of the claim: map it once */
        for (int d = 0; d < VGPU_MAX_DEVICES && g_own_path[0] && from < 0; d++)
            if (g_own[d]) from = d;
        if (from >= 0) {
            f = g_own[from];
            g_own_dev[dev] = g_own_dev[from];
            g_own_ino[dev] = g_own_ino[from];
        } else {
            f = map_own(dev, slice_id);
        }
        g_own[dev] = f;
    }
    pthread_mutex_unlock(&g_mu);
    if (f == NULL) return NULL;
    struct vgpu_demand_entry *e = &f->dev[dev];
    struct vgpu_node_slot *s = &e->d;
    __atomic_store_n(&s->cap_permille, cap_permille ? cap_permille : 1000u, __ATOMIC_RELAXED);
    __atomic_store_n(&s->policy, policy, __ATOMIC_RELAXED);
    __atomic_store_n(&s->priority, priority, __ATOMIC_RELAXED);
    memcpy(e->uuid, uuid, 16);
    uint64_t zero = 0;
    __atomic_compare_exchange_n(&s->slice_id, &zero, slice_id, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return s;
}

/* g_mu held: list the directory's demand files again. */
static void scan(int dfd) {
    for (int i = 0; i < g_npeers; i++) close(g_peer_fd[i]);
    g_npeers = 0;
    int lfd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = lfd >= 0 ? fdopendir(lfd) : NULL;
    if (d == NULL) {
        if (lfd >= 0) close(lfd);
        return;
    }
    time_t now_s = time(NULL);
    struct dirent *de;
    while ((de = readdir(d)) != NULL && g_npeers < MAX_PEERS) {
        size_t n = strlen(de->d_name);
        if (n <= 7 || strcmp(de->d_name + n - 7, ".demand") != 0) continue;
        int fd = openat(dfd, de->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) continue;
        struct stat st;
        int keep = vgpu_fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
        for (int k = 0; keep && k < VGPU_MAX_DEVICES; k++)
            if (g_own[k] && st.st_dev == g_own_dev[k] && st.st_ino == g_own_ino[k]) keep = 0; /* mine */
        if (keep && g_dir_shared && st.st_uid != geteuid() && st.st_uid != 0) keep = 0;
        if (keep && !g_own_path[0] && st.st_uid == geteuid() && st.st_mtime < now_s - STALE_FILE_S) {
            unlinkat(dfd, de->d_name, 0); /* a slice of ours that ended long ago */
            keep = 0;
        }
        if (keep)
            g_peer_fd[g_npeers++] = fd;
        else
            close(fd);
    }
    closedir(d);
}

int vgpu_demand_peers(const uint8_t uuid[16], int64_t now, struct vgpu_node_slot *out, int max) {
    if (pthread_mutex_trylock(&g_mu) != 0) return -1; /* another thread is at it: skip this check */
    int dfd = dir_fd();
    if (dfd < 0) {
        pthread_mutex_unlock(&g_mu);
        return -1;
    }
    int64_t t = mono_ns();
    if (t >= g_next_scan) {
        scan(dfd);
        g_next_scan = t + SCAN_NS;
    }
    int n = 0;
    for (int i = 0; i < g_npeers && n < max; i++) {
        struct vgpu_demand_file copy;
        ssize_t got = pread(g_peer_fd[i], &copy, sizeof copy, 0);
        if (got > 0 && vc_peer_demand(&copy, (size_t)got, uuid, now, &out[n])) n++;
    }
    pthread_mutex_unlock(&g_mu);
    return n;
}

void vgpu_demand_atfork_child(void) { pthread_mutex_init(&g_mu, NULL); }

/*
 * Read-only views of other node states (SIMGPU_OBSERVE; observe.h says what is trusted).
 *
 * Nothing here maps a file or takes a lock of it: a writer of the state may truncate it, fill it
 * with garbage, or stop while holding its locks, and the observer still answers at once. Every
 * read is a pread of a fixed size into private memory after an fstat; a short read is an empty
 * state. Files are opened without following links (O_PATH, checked to be a regular file, then
 * reopened through /proc/self/fd: a FIFO or a device node a writer planted is never opened), so
 * opening has no side effect whatever the directory holds.
 */
#define _GNU_SOURCE 1 /* O_PATH, F_OFD_GETLK */
#include "observe.h"

#include "busy.h"
#include "sched.h"
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A regular file `name` in directory `dfd`, opened read-only without following a link and
 * without opening anything that is not a regular file; -1 otherwise. *size: its size. */
static int open_regular(int dfd, const char *name, off_t *size) {
    int pfd = openat(dfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (pfd < 0) return -1;
    struct stat st;
    int fd = -1;
    if (fstat(pfd, &st) == 0 && S_ISREG(st.st_mode)) {
        char proc[64];
        snprintf(proc, sizeof proc, "/proc/self/fd/%d", pfd);
        fd = open(proc, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
        struct stat again;
        if (fd >= 0 && (fstat(fd, &again) != 0 || again.st_dev != st.st_dev || again.st_ino != st.st_ino)) {
            close(fd);
            fd = -1;
        }
        if (fd >= 0 && size) *size = again.st_size;
    }
    close(pfd);
    return fd;
}

/* All of [off, off + len) or nothing (a file shrunk meanwhile reads short). */
static int read_at(int fd, void *buf, size_t len, off_t off) {
    size_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, (char *)buf + got, len - got, off + (off_t)got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        got += (size_t)n;
    }
    return 0;
}

/* The header of a state, as far as an observer reads it. */
typedef struct {
    uint64_t magic;
    uint64_t size;
} head_copy;

static int slot_lock_held(int fd, int slot) {
    struct flock fl = {
        .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = SIM_SLOT_LOCK_BASE + slot, .l_len = 1, .l_pid = 0};
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return 0; /* cannot tell: an observer lists nothing on doubt */
    return fl.l_type != F_UNLCK;
}

static unsigned lock_holder_pid(int pid_fd, int slot) {
    if (pid_fd < 0) return 0;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = slot, .l_len = 1, .l_pid = 0};
    if (fcntl(pid_fd, F_GETLK, &fl) != 0 || fl.l_type == F_UNLCK || fl.l_pid <= 0) return 0;
    return (unsigned)fl.l_pid;
}

/* The live slots of one state file on `dev` into *out; -1 if the file is not a readable state. */
static int read_state(int dfd, int dev, uint64_t total, sim_obs_state *out, sim_proc_slot *slots) {
    char name[64], pids[80];
    sim_state_file_name(name, sizeof name);
    snprintf(pids, sizeof pids, "%s.pids", name);
    off_t size = 0;
    int fd = open_regular(dfd, name, &size);
    if (fd < 0) return -1;
    struct stat mine, theirs;
    int own = sim_state_fd();
    if (own >= 0 && fstat(own, &mine) == 0 && fstat(fd, &theirs) == 0 && mine.st_dev == theirs.st_dev &&
        mine.st_ino == theirs.st_ino) {
        close(fd); /* this process's own state (SIMGPU_STATE among the observed): counted once */
        return -1;
    }
    head_copy h;
    uint64_t active[(SIM_MAX_PROCS + 63) / 64];
    if ((uint64_t)size < sizeof(sim_shared) || read_at(fd, &h, sizeof h, (off_t)offsetof(sim_shared, magic)) != 0 ||
        h.magic != SIM_STATE_MAGIC || h.size != sizeof(sim_shared) ||
        read_at(fd, active, sizeof active, (off_t)offsetof(sim_shared, active)) != 0 ||
        read_at(fd, slots, sizeof(sim_proc_slot) * SIM_MAX_PROCS, (off_t)offsetof(sim_shared, proc)) != 0) {
        close(fd);
        return -1;
    }
    int pid_fd = open_regular(dfd, pids, NULL);
    out->fd = fd;
    out->nproc = 0;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        if (!((active[i / 64] >> (i % 64)) & 1)) continue;
        const sim_proc_slot *s = &slots[i];
        if ((s->contexts[dev] == 0 && s->used[dev] == 0) || !slot_lock_held(fd, i)) continue;
        out->proc[out->nproc++] = (sim_obs_proc){.slot = i,
                                                 .gen = s->gen,
                                                 .pid = lock_holder_pid(pid_fd, i),
                                                 .used = s->used[dev] < total ? s->used[dev] : total,
                                                 .contexts = s->contexts[dev] != 0};
    }
    if (pid_fd >= 0) close(pid_fd);
    return 0;
}

/* SIMGPU_OBSERVE: "DIR" or "DIR/<star>" (every subdirectory of DIR is a state directory) or
 * "DIR/<star>/NAME" (every NAME, one component, in a subdirectory of DIR). Returns 0 with root and
 * name (empty: none) filled in, -1 if malformed. */
static int parse_observe(const char *v, char *root, size_t rcap, char *name, size_t ncap) {
    const char *star = strstr(v, "/*");
    name[0] = '\0';
    if (!star) {
        snprintf(root, rcap, "%s", v);
        return 0;
    }
    if ((size_t)(star - v) >= rcap || strstr(star + 2, "*")) return -1;
    snprintf(root, rcap, "%.*s", (int)(star - v), v);
    if (root[0] == '\0') snprintf(root, rcap, "/");
    const char *rest = star + 2;
    if (*rest == '\0') return 0;
    if (*rest != '/' || !rest[1] || strchr(rest + 1, '/') || strcmp(rest + 1, ".") == 0 || strcmp(rest + 1, "..") == 0)
        return -1;
    snprintf(name, ncap, "%s", rest + 1);
    return strlen(rest + 1) < ncap ? 0 : -1;
}

void sim_observe_open(sim_obs_set *set, int dev, uint64_t total) {
    set->n = 0;
    set->st = NULL;
    const char *v = getenv("SIMGPU_OBSERVE");
    if (!v || !*v || dev < 0 || dev >= SIM_MAX_DEVICES) return;
    static int warned;
    char root[512], name[256];
    if (parse_observe(v, root, sizeof root, name, sizeof name) != 0) {
        if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
            sim_log("environment SIMGPU_OBSERVE=%s is malformed; allowed: DIR, DIR/* or DIR/*/NAME (nothing observed)",
                    v);
        return;
    }
    int rfd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = rfd >= 0 ? fdopendir(rfd) : NULL;
    if (!d) {
        if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
            sim_log("SIMGPU_OBSERVE=%s: %s: %s; allowed: a directory of state directories (nothing observed)", v, root,
                    strerror(errno));
        if (rfd >= 0) close(rfd);
        return;
    }
    sim_proc_slot *slots = malloc(sizeof(sim_proc_slot) * SIM_MAX_PROCS);
    struct dirent *e;
    int cap = 0;
    while (slots && (e = readdir(d)) != NULL && set->n < SIM_OBSERVE_MAX) {
        if (e->d_name[0] == '.') continue;
        int sfd = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (sfd >= 0 && name[0]) {
            int inner = openat(sfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            close(sfd);
            sfd = inner;
        }
        if (sfd < 0) continue; /* not a directory, or a link */
        if (set->n == cap) {
            int ncap = cap ? cap * 2 : 8;
            sim_obs_state *n = realloc(set->st, sizeof *n * (size_t)ncap);
            if (!n) {
                close(sfd);
                break;
            }
            set->st = n;
            cap = ncap;
        }
        if (read_state(sfd, dev, total, &set->st[set->n], slots) == 0) set->n++;
        close(sfd);
    }
    static int capped;
    if (set->n == SIM_OBSERVE_MAX && readdir(d) != NULL && !__atomic_exchange_n(&capped, 1, __ATOMIC_RELAXED))
        sim_log("SIMGPU_OBSERVE=%s: more than %d state directories; the others are not observed", v, SIM_OBSERVE_MAX);
    free(slots);
    closedir(d);
}

void sim_observe_close(sim_obs_set *set) {
    for (int i = 0; i < set->n; i++) close(set->st[i].fd);
    free(set->st);
    set->st = NULL;
    set->n = 0;
}

uint64_t sim_observe_used(const sim_obs_set *set) {
    uint64_t sum = 0;
    for (int i = 0; i < set->n; i++)
        for (int j = 0; j < set->st[i].nproc; j++) {
            uint64_t u = set->st[i].proc[j].used;
            sum = sum > UINT64_MAX - u ? UINT64_MAX : sum + u;
        }
    return sum;
}

uint64_t sim_observe_busy(const sim_obs_state *st, int dev, const sim_obs_proc *p, uint64_t from, uint64_t to,
                          uint64_t now, uint64_t *window_ns) {
    *window_ns = 0;
    if (dev < 0 || dev >= SIM_MAX_DEVICES) return 0;
    /* The scheduler's state first, the ring after: work the state's own processes record in
     * between is at worst counted twice (clamped by the caller's percentage), never lost. */
    sim_run r;
    off_t sched_off = (off_t)(offsetof(sim_shared, sched) + (size_t)dev * sizeof(sim_sched) + offsetof(sim_sched, run));
    if (read_at(st->fd, &r, sizeof r, sched_off) != 0) return 0;
    uint64_t bucket = p ? SIM_PBUCKET_NS : SIM_BUCKET_NS, n = p ? SIM_PROC_RING : SIM_DEV_RING;
    uint64_t *ring = malloc(n * sizeof *ring);
    if (!ring) return 0;
    off_t ring_off;
    if (p) {
        size_t k = (size_t)p->slot * SIM_MAX_DEVICES + (size_t)dev;
        uint32_t gen;
        if (read_at(st->fd, &gen, sizeof gen, (off_t)(offsetof(sim_shared, proc_ring_gen) + k * sizeof gen)) != 0) {
            free(ring);
            return 0;
        }
        ring_off = (off_t)(offsetof(sim_shared, proc_ring) + k * SIM_PROC_RING * sizeof(uint64_t));
        if (gen != p->gen) ring_off = -1; /* the slot's owner never ran on the device */
    } else {
        ring_off =
            (off_t)(offsetof(sim_shared, dev) + (size_t)dev * sizeof(sim_dev_state) + offsetof(sim_dev_state, ring));
    }
    if (ring_off < 0)
        memset(ring, 0, n * sizeof *ring);
    else if (read_at(st->fd, ring, n * sizeof *ring, ring_off) != 0) {
        free(ring);
        return 0;
    }
    uint64_t busy = sim_busy_sum_copy(ring, n, bucket, from, to, window_ns);
    free(ring);
    if (*window_ns == 0) return 0;
    /* The same complete buckets for the part nobody has recorded yet. */
    uint64_t wto = to / bucket * bucket, wfrom = wto - *window_ns;
    busy += sim_sched_project(&r, now < wto ? now : wto, p ? p->slot : -1, wfrom, wto);
    return busy < *window_ns ? busy : *window_ns;
}

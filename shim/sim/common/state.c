/*
 * Node-wide state of the simulated GPUs, shared by every process through one memory-mapped file
 * in $SIMGPU_STATE (default /tmp/simgpu-<uid>):
 *
 *  - each device's memory is one pool: `used` is the sum of what every live process charged;
 *  - every process that creates a context owns a slot recording what it charged per device
 *    (NVML's process list) and its busy time (NVML's per-process utilisation);
 *  - each device has a scheduler (sched.c) time-slicing it between the processes' lanes, and a
 *    ring of 10 ms buckets of busy time (NVML's utilisation, busy.c), written as the device runs.
 *
 * Robustness against SIGKILL at any instant:
 *  - `used`, `active` and the per-slot counters change only under a PTHREAD_MUTEX_ROBUST,
 *    process-shared mutex. A holder that dies mid-update hands the next locker EOWNERDEAD; it
 *    then recomputes every derived total from the slots (device used = sum of slot used), which
 *    is correct whatever instant the owner died at, and marks the mutex consistent.
 *  - Liveness of a slot is an fcntl open-file-description (OFD) write lock on one byte of the
 *    state file (offset SIM_SLOT_LOCK_BASE + slot, past the end of the file) held for the process
 *    lifetime. The kernel drops it when the process dies, however it dies, and it works across
 *    PID namespaces (no PIDs are compared). The locks go through their own open file description,
 *    not the one the file is mapped through (a fork child inherits mappings). Dead slots are reaped by whoever next takes the lock
 *    to touch memory, so a killed process's memory is back before any other process's next
 *    memory call.
 *  - PIDs as the kernel driver reports them: the driver lists the PIDs of the initial PID
 *    namespace (the host's), whatever namespace its caller or the process runs in. A process in
 *    a container cannot learn its host PID, but the kernel translates PIDs of lock holders: each
 *    slot's owner also holds a classic (per-process) fcntl write lock on byte `slot` of a second
 *    file (`<state>.pids`, opened once per process and never closed: closing any descriptor of a
 *    file drops the process's classic locks on it), and a lister asks F_GETLK, whose l_pid is the
 *    holder's PID in the lister's own namespace: the host PID for a lister on the host. The slot's
 *    recorded getpid() is the answer when the kernel has none (the lister's own slots, a holder
 *    outside the lister's namespace).
 *  - The busy rings are single 64-bit atomics updated by CAS. The scheduler's state is under a
 *    robust mutex of its own per device (sched.c: what a holder's death can leave behind).
 */
#define _GNU_SOURCE 1 /* F_OFD_GETLK, F_OFD_SETLK */
#include "state.h"

#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

sim_shared *sim_shm;
static int g_fd = -1;
static char g_path[600];
static int g_pid_fd = -1; /* <state>.pids: classic fcntl locks, one byte per slot (never closed) */
static int g_shared_dir;  /* the state directory is sticky and writable by all: its users share the node */

/* The state directory, opened and checked: a root process must never follow a link another user
 * planted, nor keep its state in someone else's directory. The default (/tmp/simgpu-<uid>) is
 * created here and must be a real directory of this user; SIMGPU_STATE may go through links
 * (the admin's choice) but must lead to a directory of this user or root, sticky if others may
 * write it. Returns the descriptor, or -1 with *why set. */
static int state_dir(char *buf, size_t cap, const char **why) {
    const char *d = getenv("SIMGPU_STATE");
    int dflt = !(d && *d);
    if (dflt)
        snprintf(buf, cap, "/tmp/simgpu-%u", (unsigned)geteuid());
    else
        snprintf(buf, cap, "%s", d);
    if (dflt && mkdir(buf, 0700) != 0 && errno != EEXIST) {
        *why = strerror(errno);
        return -1;
    }
    int fd = open(buf, O_RDONLY | O_DIRECTORY | O_CLOEXEC | (dflt ? O_NOFOLLOW : 0));
    if (fd < 0) {
        *why = errno == ELOOP || errno == ENOTDIR ? "not a directory (a link?)" : strerror(errno);
        return -1;
    }
    struct stat st;
    *why = NULL;
    if (fstat(fd, &st) != 0)
        *why = strerror(errno);
    else if (st.st_uid != geteuid() && (dflt || st.st_uid != 0))
        *why = "it belongs to another user";
    else if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX))
        *why = "others may write it and it has no sticky bit";
    g_shared_dir = (st.st_mode & S_IWOTH) && (st.st_mode & S_ISVTX);
    if (*why) {
        close(fd);
        return -1;
    }
    return fd;
}

/* A new open file description of the file `fd` is open on: by path, accepted only if it is still
 * the same file (it may have been replaced meanwhile), else through /proc. */
static int reopen_same(int fd) {
    int nfd = open(g_path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (nfd >= 0) {
        struct stat a, b;
        if (fstat(fd, &a) == 0 && fstat(nfd, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) return nfd;
        close(nfd);
    }
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    return open(proc, O_RDWR | O_CLOEXEC);
}

/* Open a file of the state directory read-write, creating it, never through a link. A file this
 * call creates is 0600, or 0666 in a directory shared by every user (sticky and writable by all:
 * every user of it shares one node, whoever started first). */
static int open_state_file(int dfd, const char *name) {
    int fd = openat(dfd, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
    if (fd >= 0) {
        if (g_shared_dir) fchmod(fd, 0666);
        return fd;
    }
    if (errno != EEXIST) return -1;
    return openat(dfd, name, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
}

/* The `.pids` file beside the state (created like it: never through a link). -1 if unusable:
 * listers then report the recorded PIDs. */
static int pid_file(void) {
    int fd = __atomic_load_n(&g_pid_fd, __ATOMIC_ACQUIRE);
    if (fd >= 0 || g_path[0] == '\0') return fd;
    char path[sizeof g_path + 8];
    snprintf(path, sizeof path, "%s.pids", g_path);
    fd = open_state_file(AT_FDCWD, path);
    struct stat st;
    if (fd >= 0 &&
        (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (st.st_uid != geteuid() && st.st_uid != 0 && !g_shared_dir))) {
        close(fd); /* before any lock of ours is on it */
        fd = -1;
    }
    int none = -1;
    if (fd >= 0 && !__atomic_compare_exchange_n(&g_pid_fd, &none, fd, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        /* another thread opened it first; ours holds no lock yet. Closing it would still drop
         * this process's locks on the file: keep it open. */
        return none;
    }
    return fd;
}

int sim_slot_host_pid(int slot, int own_slot) {
    int32_t recorded = sim_shm->proc[slot].pid;
    int fd = slot == own_slot ? -1 : pid_file();
    if (fd < 0) return recorded;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = slot, .l_len = 1, .l_pid = 0};
    if (fcntl(fd, F_GETLK, &fl) != 0 || fl.l_type == F_UNLCK || fl.l_pid <= 0)
        return recorded; /* ours (no conflict with ourselves), or not visible from here */
    return fl.l_pid;
}

void sim_state_file_name(char *buf, size_t cap) { snprintf(buf, cap, "state-v1-%zu", sizeof(sim_shared)); }

int sim_state_open(void) {
    if (sim_shm) return 0;
    char dir[512];
    const char *why;
    int dfd = state_dir(dir, sizeof dir, &why);
    if (dfd < 0) {
        sim_log("state directory %s refused: %s; allowed: SIMGPU_STATE naming a directory of this user (default "
                "/tmp/simgpu-<uid>)",
                dir, why);
        return -1;
    }
    char name[64];
    sim_state_file_name(name, sizeof name);
    snprintf(g_path, sizeof g_path, "%s/%s", dir, name);
    int fd = open_state_file(dfd, name);
    close(dfd);
    struct stat fst;
    if (fd >= 0 && (fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode))) {
        close(fd);
        fd = -1;
        errno = EINVAL;
    }
    if (fd < 0) {
        sim_log("state file %s: %s; allowed: SIMGPU_STATE naming a writable directory", g_path, strerror(errno));
        return -1;
    }
    /* flock serialises first-time initialisation between processes starting together; it is
     * released by the kernel if the holder dies, and does not interact with the OFD slot locks. */
    if (flock(fd, LOCK_EX) != 0) {
        sim_log("state file %s: flock: %s", g_path, strerror(errno));
        close(fd);
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 ||
        ((size_t)st.st_size < sizeof(sim_shared) && ftruncate(fd, (off_t)sizeof(sim_shared)) != 0)) {
        sim_log("state file %s: cannot size it: %s", g_path, strerror(errno));
        flock(fd, LOCK_UN);
        close(fd);
        return -1;
    }
    void *p = mmap(NULL, sizeof(sim_shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        sim_log("state file %s: mmap: %s", g_path, strerror(errno));
        flock(fd, LOCK_UN);
        close(fd);
        return -1;
    }
    /* Re-check the size once mapped: a file shrunk between the sizing and the mapping (by a
     * process sharing the directory) would fault at the first access past its end. */
    struct stat mapped;
    if (fstat(fd, &mapped) != 0 || (size_t)mapped.st_size < sizeof(sim_shared)) {
        sim_log("state file %s: shrunk to %lld bytes while being opened (another process truncated it?)", g_path,
                (long long)mapped.st_size);
        munmap(p, sizeof(sim_shared));
        flock(fd, LOCK_UN);
        close(fd);
        return -1;
    }
    sim_shared *s = p;
    if (__atomic_load_n(&s->magic, __ATOMIC_ACQUIRE) != SIM_STATE_MAGIC || s->size != sizeof(sim_shared)) {
        /* New (zero-filled) file, or one whose initialiser died before finishing: only the latter
         * is cleared (clearing a new file would commit every page of its rings for nothing). */
        if (st.st_size != 0) memset(s, 0, sizeof *s);
        sim_robust_mutex_init(&s->lock);
        for (int d = 0; d < SIM_MAX_DEVICES; d++) {
            sim_robust_mutex_init(&s->sched[d].lock);
            s->sched[d].run.owner = -1;
        }
        s->size = sizeof(sim_shared);
        __atomic_store_n(&s->magic, SIM_STATE_MAGIC, __ATOMIC_RELEASE);
    }
    flock(fd, LOCK_UN);
    /* The slot locks go through a second, fresh open file description that nothing but g_fd
     * refers to. A mapping holds a reference to the description it was made from, and a fork
     * child inherits the mapping: locks taken through `fd`'s description would stay held while
     * any child of the holder lives, keeping a dead parent's slot (and memory) alive. */
    int lock_fd = reopen_same(fd);
    close(fd); /* the mapping keeps its (never locked) description */
    if (lock_fd < 0) {
        sim_log("state file %s: cannot open a second descriptor: %s", g_path, strerror(errno));
        munmap(p, sizeof(sim_shared));
        return -1;
    }
    g_fd = lock_fd;
    sim_shm = s;
    return 0;
}

int sim_state_fd(void) { return g_fd; }

void sim_robust_mutex_init(pthread_mutex_t *m) {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
}

static int share_holds(const sim_vmm_share *e, int slot) { return (int)((e->holders[slot / 64] >> (slot % 64)) & 1); }

/* An entry's fields as read from the shared file: in range, or the entry is dropped (its bytes are
 * then only in its carrier's slot, returned when that slot goes). */
static int share_valid(const sim_vmm_share *e) {
    return e->key != 0 && e->dev >= 0 && e->dev < SIM_MAX_DEVICES && e->carrier >= 0 && e->carrier < SIM_MAX_PROCS;
}

static void recompute_totals(void) {
    /* a holder that died mid-update may have left an entry half-changed: holders that are no
     * slot any more go, an entry nobody holds is dropped */
    for (int k = 0; k < SIM_MAX_VMM_SHARES; k++) {
        sim_vmm_share *e = &sim_shm->vmm[k];
        if (e->key == 0) continue;
        uint64_t any = 0;
        for (int w = 0; w < (SIM_MAX_PROCS + 63) / 64; w++) any |= e->holders[w] &= sim_shm->active[w];
        if (!share_valid(e) || !any) memset(e, 0, sizeof *e);
    }
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        uint64_t used = 0;
        for (int i = 0; i < SIM_MAX_PROCS; i++)
            if (sim_slot_active(i)) used += sim_shm->proc[i].used[d];
        sim_shm->dev[d].used = used;
    }
}

/* How long a locker waits for a holder that does not release a lock of the state: the updates
 * under them take microseconds, so only a holder that is stopped (SIGSTOP, a debugger) or a lock
 * word that is not a lock (overwritten) makes anyone wait that long. */
static uint64_t lock_timeout_ns(void) {
    static _Atomic uint64_t v;
    uint64_t ns = atomic_load_explicit(&v, memory_order_relaxed);
    if (ns) return ns;
    uint64_t ms = sim_env_u64("SIMGPU_LOCK_TIMEOUT_MS", 10000);
    if (ms < 10 || ms > 3600000) {
        sim_log("environment SIMGPU_LOCK_TIMEOUT_MS=%llu is out of range; allowed: 10 .. 3600000 ms; using 10000",
                (unsigned long long)ms);
        ms = 10000;
    }
    atomic_store_explicit(&v, ms * 1000000ull, memory_order_relaxed);
    return ms * 1000000ull;
}

#ifdef __GLIBC__
/* The mutex kind word the state's locks were initialised with: another value is not one of our
 * locks (the file was overwritten), and locking it could block for ever or crash. */
static int lock_kind_ok(pthread_mutex_t *m) {
    static int ref = -1;
    int k = __atomic_load_n(&ref, __ATOMIC_RELAXED);
    if (k == -1) {
        pthread_mutex_t r;
        sim_robust_mutex_init(&r);
        k = r.__data.__kind;
        pthread_mutex_destroy(&r);
        __atomic_store_n(&ref, k, __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&m->__data.__kind, __ATOMIC_RELAXED) == k;
}
#else
static int lock_kind_ok(pthread_mutex_t *m) { return 1; }
#endif

int sim_robust_lock(pthread_mutex_t *m, _Atomic int *wedged, const char *what) {
    if (!lock_kind_ok(m)) {
        sim_log("%s lock of state %s is not a lock (overwritten): initialised again", what, g_path);
        sim_robust_mutex_init(m);
    }
    int rc = pthread_mutex_trylock(m); /* uncontended: no clock read, no system call */
    if (rc == EBUSY && !atomic_load_explicit(wedged, memory_order_relaxed)) {
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        uint64_t ns = (uint64_t)dl.tv_nsec + lock_timeout_ns();
        dl.tv_sec += (time_t)(ns / 1000000000ull);
        dl.tv_nsec = (long)(ns % 1000000000ull);
        rc = pthread_mutex_timedlock(m, &dl);
    }
    if (rc == 0 || rc == EOWNERDEAD) {
        atomic_store_explicit(wedged, 0, memory_order_relaxed);
        return rc == 0 ? 1 : 2;
    }
    if (!atomic_exchange_explicit(wedged, 1, memory_order_relaxed))
        sim_log("%s lock of state %s: %s (its holder does not release it: stopped?); going on without it", what, g_path,
                rc == ETIMEDOUT ? "not released in time" : strerror(rc));
    return 0;
}

static __thread int t_state_held;
static _Atomic int g_state_wedged;

void sim_state_lock(void) {
    int rc = sim_robust_lock(&sim_shm->lock, &g_state_wedged, "the");
    t_state_held = rc != 0;
    /* The previous owner died holding the lock (2), or holds it and does not return (0), maybe
     * mid-update: rebuild what is derived. */
    if (rc != 1) recompute_totals();
    if (rc == 2) pthread_mutex_consistent(&sim_shm->lock);
}

void sim_state_unlock(void) {
    if (t_state_held) pthread_mutex_unlock(&sim_shm->lock);
    t_state_held = 0;
}

int sim_slot_alive(int slot, int own_slot) {
    if (slot == own_slot) return 1; /* our own OFD lock does not conflict with our own query */
    struct flock fl = {
        .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = SIM_SLOT_LOCK_BASE + slot, .l_len = 1, .l_pid = 0};
    if (fcntl(g_fd, F_OFD_GETLK, &fl) != 0) return 1; /* cannot tell: never reap on doubt */
    return fl.l_type != F_UNLCK;
}

/* Slot holds e no more: if it carried e's bytes, they move to another holder, or leave the device
 * with the last holder. State lock held. */
static void share_drop_locked(sim_vmm_share *e, int slot) {
    if (!share_valid(e) || !share_holds(e, slot)) return;
    e->holders[slot / 64] &= ~(1ull << (slot % 64));
    int next = -1;
    for (int i = 0; i < SIM_MAX_PROCS && next < 0; i++)
        if (share_holds(e, i) && sim_slot_active(i)) next = i;
    uint64_t *from = &sim_shm->proc[e->carrier].used[e->dev];
    uint64_t b = *from >= e->bytes ? e->bytes : *from;
    if (next >= 0 && e->carrier == slot) {
        *from -= b;
        sim_shm->proc[next].used[e->dev] += b;
        e->carrier = next;
    } else if (next < 0) {
        *from -= b;
        sim_dev_state *d = &sim_shm->dev[e->dev];
        d->used = d->used >= b ? d->used - b : 0;
        memset(e, 0, sizeof *e);
    }
}

static void free_slot_locked(int i) {
    sim_proc_slot *p = &sim_shm->proc[i];
    for (int k = 0; k < SIM_MAX_VMM_SHARES; k++)
        if (sim_shm->vmm[k].key != 0) share_drop_locked(&sim_shm->vmm[k], i);
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        uint64_t u = p->used[d];
        sim_shm->dev[d].used = sim_shm->dev[d].used >= u ? sim_shm->dev[d].used - u : 0;
        p->used[d] = 0;
        p->contexts[d] = 0;
    }
    p->pid = 0;
    sim_shm->active[i / 64] &= ~(1ull << (i % 64));
}

void sim_state_reap_locked(int own_slot) {
    for (int i = 0; i < SIM_MAX_PROCS; i++)
        if (sim_slot_active(i) && !sim_slot_alive(i, own_slot)) free_slot_locked(i);
}

int sim_state_claim_slot(void) {
    int got = -1;
    sim_state_lock();
    /* Reap only when no slot is free: a dead process's memory is returned anyway before any
     * charge that would not fit and before any query (sim_mem_charge, sim_mem_used, NVML), and
     * a reap costs a system call per live slot. */
    for (int pass = 0; pass < 2 && got < 0; pass++) {
        if (pass == 1) sim_state_reap_locked(-1);
        for (int i = 0; i < SIM_MAX_PROCS && got < 0; i++) {
            if (sim_slot_active(i)) continue;
            struct flock fl = {
                .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = SIM_SLOT_LOCK_BASE + i, .l_len = 1, .l_pid = 0};
            if (fcntl(g_fd, F_OFD_SETLK, &fl) != 0) continue; /* held by someone: not ours to take */
            sim_proc_slot *p = &sim_shm->proc[i];
            memset(p->used, 0, sizeof p->used);
            memset(p->contexts, 0, sizeof p->contexts);
            p->pid = (int32_t)getpid();
            int pfd = pid_file();
            struct flock pl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = i, .l_len = 1, .l_pid = 0};
            if (pfd >= 0 && fcntl(pfd, F_SETLK, &pl) != 0)
                sim_log("state file %s.pids: slot %d: %s (NVML lists this process by its own PID)", g_path, i,
                        strerror(errno));
            __atomic_store_n(&p->gen, p->gen + 1, __ATOMIC_RELEASE); /* its busy rings: stale */
            sim_shm->active[i / 64] |= 1ull << (i % 64);
            got = i;
        }
    }
    sim_state_unlock();
    if (got < 0) sim_log("all %d process slots of the simulated node are in use (state %s)", SIM_MAX_PROCS, g_path);
    return got;
}

void sim_state_after_fork_child(void) {
    /* The inherited descriptor shares the parent's open file description and with it the
     * parent's slot lock: keeping it would make the parent look alive after it died. (The
     * inherited mapping refers to another, never locked description: see sim_state_open.) */
    /* Classic locks are not inherited: the child holds none on `.pids`, whose descriptor it keeps. */
    if (g_fd >= 0) {
        close(g_fd);
        g_fd = open(g_path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    }
}

int sim_mem_charge(int slot, int dev, uint64_t bytes, uint64_t total) {
    if (slot < 0 || dev < 0 || dev >= SIM_MAX_DEVICES) return -1;
    int rc = 0;
    sim_state_lock();
    sim_dev_state *d = &sim_shm->dev[dev];
    /* Reaping costs a syscall per live slot: do it only when the charge would not fit. A dead
     * process's memory is thus back before any charge fails and before any query reports it. */
    if (bytes > total || d->used > total - bytes) sim_state_reap_locked(slot);
    if (bytes > total || d->used > total - bytes) {
        rc = -1;
    } else {
        d->used += bytes;
        sim_shm->proc[slot].used[dev] += bytes;
    }
    sim_state_unlock();
    return rc;
}

void sim_mem_uncharge(int slot, int dev, uint64_t bytes) {
    if (slot < 0 || dev < 0 || dev >= SIM_MAX_DEVICES || bytes == 0) return;
    sim_state_lock();
    sim_proc_slot *p = &sim_shm->proc[slot];
    uint64_t b = p->used[dev] >= bytes ? bytes : p->used[dev];
    p->used[dev] -= b;
    sim_shm->dev[dev].used = sim_shm->dev[dev].used >= b ? sim_shm->dev[dev].used - b : 0;
    sim_state_unlock();
}

static sim_vmm_share *share_find_locked(int dev, uint64_t key) {
    for (int k = 0; k < SIM_MAX_VMM_SHARES; k++) {
        sim_vmm_share *e = &sim_shm->vmm[k];
        if (e->key == key && e->dev == dev && share_valid(e)) return e;
    }
    return NULL;
}

int sim_vmm_share_create(int slot, int dev, uint64_t key, uint64_t bytes, uint64_t total) {
    if (slot < 0 || slot >= SIM_MAX_PROCS || dev < 0 || dev >= SIM_MAX_DEVICES || key == 0) return -2;
    int rc = 0;
    sim_state_lock();
    /* an entry of this key is stale: the file it named is gone (a holder keeps it open), so its
     * holders died unreaped and the kernel gave the inode number again */
    if (share_find_locked(dev, key)) sim_state_reap_locked(slot);
    sim_vmm_share *e = NULL;
    for (int k = 0; k < SIM_MAX_VMM_SHARES && !e; k++)
        if (sim_shm->vmm[k].key == 0) e = &sim_shm->vmm[k];
    sim_dev_state *d = &sim_shm->dev[dev];
    if (e && (bytes > total || d->used > total - bytes)) sim_state_reap_locked(slot);
    if (!e) {
        rc = -2;
    } else if (bytes > total || d->used > total - bytes) {
        rc = -1;
    } else {
        d->used += bytes;
        sim_shm->proc[slot].used[dev] += bytes;
        memset(e, 0, sizeof *e);
        e->bytes = bytes;
        e->dev = dev;
        e->carrier = slot;
        e->holders[slot / 64] = 1ull << (slot % 64);
        e->key = key;
    }
    sim_state_unlock();
    return rc;
}

int sim_vmm_share_hold(int slot, int dev, uint64_t key) {
    if (slot < 0 || slot >= SIM_MAX_PROCS || dev < 0 || dev >= SIM_MAX_DEVICES || key == 0) return -1;
    sim_state_lock();
    sim_vmm_share *e = share_find_locked(dev, key);
    if (e) e->holders[slot / 64] |= 1ull << (slot % 64);
    sim_state_unlock();
    return e ? 0 : -1;
}

void sim_vmm_share_drop(int slot, int dev, uint64_t key) {
    if (slot < 0 || slot >= SIM_MAX_PROCS || dev < 0 || dev >= SIM_MAX_DEVICES || key == 0) return;
    sim_state_lock();
    sim_vmm_share *e = share_find_locked(dev, key);
    if (e) share_drop_locked(e, slot);
    sim_state_unlock();
}

uint64_t sim_mem_used(int dev, int own_slot) {
    sim_state_lock();
    sim_state_reap_locked(own_slot);
    uint64_t u = sim_shm->dev[dev].used;
    sim_state_unlock();
    return u;
}

void sim_ctx_count(int slot, int dev, int delta) {
    if (slot < 0 || dev < 0 || dev >= SIM_MAX_DEVICES) return;
    sim_state_lock();
    uint32_t *c = &sim_shm->proc[slot].contexts[dev];
    if (delta < 0 && *c < (uint32_t)-delta)
        *c = 0;
    else
        *c = (uint32_t)((int64_t)*c + delta);
    sim_state_unlock();
}

/*
 * The slice accounting region (layout and protocol: vgpu/region.h).
 *
 * Crash-safety without startup serialisation:
 *  - creation is build-in-temp-file + link(): no process sees a half-built file, nobody waits;
 *  - charges are made under a lock word whose critical sections make no system calls; a holder
 *    killed inside, garbage in the word or a hung holder make the next locker take it over (at
 *    the latest after 2 s) and recompute the totals (see "the lock" below);
 *  - slot ownership is an fcntl OFD byte lock held for the process lifetime: the kernel drops it
 *    at death, in every PID namespace, so a slot whose byte can be locked is a dead process's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <limits.h>
#include <linux/futex.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "region.h"
#include "log.h"
#include "region_init.h"
#include "safefile.h"
#include "shim_internal.h"

_Static_assert(sizeof(pthread_mutex_t) <= sizeof(((struct vgpu_region *)0)->lock), "mutex does not fit");
_Static_assert(_Alignof(pthread_mutex_t) <= _Alignof(uint64_t), "mutex alignment");

#define SCAN_INTERVAL_NS 100000000ULL /* dead-slot scan on allocation at most every 100 ms */

static struct vgpu_region *R;            /* the mapping, NULL when no region is in use */
static int region_fd = -1;               /* O_CLOEXEC; its open file description holds our slot lock */
static int my_slot = -1;                 /* -1: not claimed yet (or dropped in a fork child) */
static int region_broken;                /* fork child could not reopen: fail closed */
static struct vgpu_region_params params; /* what vgpu_region_open was given */
static int region_required;              /* the compute cap needs the region without a memory limit */
static void (*on_exit_fn)(void);         /* run at a normal exit while the slot is held */
/* Process-local: byte locks belong to our open file description, not to a thread, so two of our
 * threads would both "get" the same slot's lock. Claims and scans take this mutex so that a slot's
 * byte lock is only ever tested by one of our threads at a time, and never our own slot. */
static pthread_mutex_t slot_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t last_scan_ns;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts); /* a few ms of resolution is plenty for a 100 ms throttle */
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

struct vgpu_region *vgpu_region(void) { return R; }

void vgpu_require_region(void) { region_required = 1; }
int vgpu_region_required(void) { return region_required; }
void vgpu_region_on_exit(void (*fn)(void)) { __atomic_store_n(&on_exit_fn, fn, __ATOMIC_RELEASE); }

/* ---- creation ---- */

static int fill_fd(int fd) {
    if (ftruncate(fd, (off_t)sizeof(struct vgpu_region)) != 0) return -1;
    void *m = mmap(NULL, sizeof(struct vgpu_region), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return -1;
    int rc = vgpu_region_init(m);
    munmap(m, sizeof(struct vgpu_region));
    return rc;
}

/* Build the file complete under a temporary name in the same directory, then link() it into
 * place. EEXIST means another process won the race: fine, we open theirs. O_EXCL never follows a
 * link, and linkat() does not follow the target name either. */
static int create_atomically(int dfd, const char *base) {
    char tmp[NAME_MAX + 1];
    static _Atomic unsigned counter;
    int n = snprintf(tmp, sizeof tmp, ".%.200s.tmp.%d.%u", base, (int)getpid(), atomic_fetch_add(&counter, 1));
    if (n < 0 || (size_t)n >= sizeof tmp) {
        errno = ENAMETOOLONG;
        return -1;
    }
    int fd = openat(dfd, tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0) return -1;
    int rc = fill_fd(fd);
    int saved = errno;
    if (rc == 0 && linkat(dfd, tmp, dfd, base, 0) != 0 && errno != EEXIST) {
        rc = -1;
        saved = errno;
    }
    unlinkat(dfd, tmp, 0);
    close(fd);
    errno = saved;
    return rc;
}

/* ---- slots ---- */

static int byte_lock(int fd, int slot, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = VGPU_SLOT_LOCK_BASE + slot;
    fl.l_len = 1;
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* Under the lock: return a slot's charges to the quota and free it. */
static void release_slot_locked(int i) {
    struct vgpu_proc_slot *s = &R->procs[i];
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t u = s->used[d];
        __atomic_store_n(&R->devices[d].used, R->devices[d].used >= u ? R->devices[d].used - u : 0, __ATOMIC_RELAXED);
        s->used[d] = 0;
    }
    s->state = VGPU_SLOT_FREE;
}

/* Under the lock: what the live slots hold on dev (the truth the total must match). */
static uint64_t used_by_live_locked(int dev) {
    uint64_t sum = 0;
    for (int i = 0; i < VGPU_MAX_PROCS; i++)
        if (R->procs[i].state == VGPU_SLOT_LIVE) sum += R->procs[i].used[dev];
    return sum;
}

/* A holder died inside a critical section: its updates may be half done. The slots are the
 * truth (each slot's counters are single stores), so recompute the totals from them. */
static void recover_locked(void) {
    uint32_t hwm = 0;
    for (int i = 0; i < VGPU_MAX_PROCS; i++)
        if (R->procs[i].state == VGPU_SLOT_LIVE) hwm = (uint32_t)i + 1;
    if (hwm > R->slots_hwm) R->slots_hwm = hwm;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        __atomic_store_n(&R->devices[d].used, used_by_live_locked(d), __ATOMIC_RELAXED);
    R->lock_recoveries++;
}

/* ---- the lock ----
 *
 * Any process of the slice can write the file, so the lock must survive garbage as well as a
 * holder's death, and never wait without bound. It is one 32-bit word (the first of `lock`:
 * creators initialise a pthread mutex there, which leaves it 0): 0 is free, otherwise the
 * holder's token: its slot index + 1 in the low TOKEN_SLOT_BITS (TOKEN_UNKNOWN while a process
 * has no slot), a per-acquisition sequence number above (so that no two acquisitions, even by
 * threads of one process, have the same token). Taken by compare-and-swap from 0, released by
 * compare-and-swap of the holder's own token back to 0; nothing in the word is ever followed or
 * trusted beyond a number. Our own threads take turns on local_mu first (a private mutex, out of
 * the tenant's reach), so at most one of them is ever at the word. A waiter takes the lock over,
 * by compare-and-swap of the token it saw (so exactly one waiter does), and recomputes the
 * totals from the live slots (recover_locked):
 *   - when the token names another process's slot whose byte lock nobody holds (its holder
 *     died: what EOWNERDEAD was for a robust mutex), or our own slot (none of our threads holds
 *     it: a dead former owner of the slot, or garbage);
 *   - when the word is not a token at all (garbage);
 *   - after LOCK_TIMEOUT_NS (a live holder takes microseconds; a holder descheduled for longer
 *     is taken for hung: its critical section may then overlap the next holder's, and the next
 *     recovery recomputes the totals).
 * The last two are logged (one line each). Waiters spin, then yield, then sleep 100 us. */
#define LOCK_TIMEOUT_NS 2000000000ULL
#define TOKEN_SLOT_BITS 11
#define TOKEN_SLOT_MASK ((1u << TOKEN_SLOT_BITS) - 1)
#define TOKEN_UNKNOWN   ((uint32_t)VGPU_MAX_PROCS + 1)
_Static_assert(VGPU_MAX_PROCS + 1 <= TOKEN_SLOT_MASK, "slot tokens do not fit");
static int pending_slot = -1; /* the slot being claimed, whose token the claim locks with */
static pthread_mutex_t local_mu = PTHREAD_MUTEX_INITIALIZER;
static uint32_t held_token; /* the token we hold the word with (under local_mu) */
static uint32_t token_seq;  /* under local_mu */

static _Atomic uint32_t *lock_word(void) { return (_Atomic uint32_t *)(void *)R->lock; }

static uint32_t new_token(void) {
    int s = my_slot >= 0 ? my_slot : pending_slot;
    uint32_t slot = s >= 0 ? (uint32_t)s + 1 : TOKEN_UNKNOWN;
    return slot | (++token_seq << TOKEN_SLOT_BITS);
}

enum holder { HOLDER_ALIVE, HOLDER_DEAD, HOLDER_GARBAGE };

/* Whether another process holds slot (0-based)'s byte lock: 1 yes (alive), 0 nobody (dead), -1
 * cannot tell. Never asked about our own slot (our own lock does not conflict with us). */
static int slot_owned(uint32_t slot) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = VGPU_SLOT_LOCK_BASE + (off_t)slot;
    fl.l_len = 1;
    if (fcntl(region_fd, F_OFD_GETLK, &fl) != 0) return -1;
    return fl.l_type != F_UNLCK;
}

static enum holder holder_state(uint32_t t, uint32_t mine) {
    uint32_t slot = t & TOKEN_SLOT_MASK;
    if (slot == TOKEN_UNKNOWN) return HOLDER_ALIVE; /* cannot tell: the timeout decides */
    if (slot == 0 || slot > VGPU_MAX_PROCS) return HOLDER_GARBAGE;
    if (slot == (mine & TOKEN_SLOT_MASK)) return HOLDER_DEAD; /* our slot, and we wait: not ours */
    /* F_OFD_GETLK: a live owner's lock on that slot's byte conflicts with ours (not our slot) */
    return slot_owned(slot - 1) == 0 ? HOLDER_DEAD : HOLDER_ALIVE;
}

int vgpu_region_lock(void) {
    pthread_mutex_lock(&local_mu);
    _Atomic uint32_t *w = lock_word();
    uint32_t mine = new_token();
    held_token = mine;
    uint64_t start = 0;
    for (unsigned round = 0;; round++) {
        uint32_t seen = 0;
        if (atomic_compare_exchange_weak_explicit(w, &seen, mine, memory_order_acquire, memory_order_relaxed)) return 0;
        if (round < 64) continue; /* held for a few instructions: spin */
        uint64_t now = now_ns();
        if (start == 0) start = now;
        enum holder h = round % 16 == 0 ? holder_state(seen, mine) : HOLDER_ALIVE;
        int timed_out = now - start > LOCK_TIMEOUT_NS;
        if ((h != HOLDER_ALIVE || timed_out) &&
            atomic_compare_exchange_strong_explicit(w, &seen, mine, memory_order_acquire, memory_order_relaxed)) {
            recover_locked();
            if (h != HOLDER_DEAD)
                vgpu_log(VGPU_LOG_WARN,
                         "accounting lock %s (word %#x): taken over, totals recomputed from the live slots",
                         h == HOLDER_GARBAGE ? "held garbage" : "held for more than 2 s", seen);
            return 0;
        }
        if (round < 256)
            sched_yield();
        else
            nanosleep(&(struct timespec){0, 100000}, NULL);
    }
}

void vgpu_region_unlock(void) {
    uint32_t mine = held_token;
    /* fails only if the word was taken over or overwritten meanwhile: it is no longer ours */
    atomic_compare_exchange_strong_explicit(lock_word(), &mine, 0, memory_order_release, memory_order_relaxed);
    pthread_mutex_unlock(&local_mu);
}

/* slot_mu held. 0 claimed; -1 every slot is taken by a live process; -2 byte locks do not work
 * on this file (errno says why). */
static int claim_slot_locked_local(void) {
    int got = -1;
    /* Lowest free slot first (keeps slots_hwm, and so every scan, short; a free slot another
     * starter is claiming costs one failed fcntl), then slots marked live whose owner may be
     * dead. The byte lock is the decision: whoever holds it owns the slot. No mutex is held. */
    for (int pass = 0; pass < 2 && got < 0; pass++) {
        uint32_t want = pass == 0 ? VGPU_SLOT_FREE : VGPU_SLOT_LIVE;
        for (int i = 0; i < VGPU_MAX_PROCS; i++) {
            if (__atomic_load_n(&R->procs[i].state, __ATOMIC_RELAXED) != want) continue;
            if (byte_lock(region_fd, i, F_WRLCK) == 0) {
                got = i;
                break;
            }
            if (errno != EAGAIN && errno != EACCES) return -2; /* not "taken": locks do not work here */
        }
    }
    if (got < 0) return -1;
    pending_slot = got; /* the claim locks with the token of the slot it holds the byte of */
    if (vgpu_region_lock() != 0) {
        byte_lock(region_fd, got, F_UNLCK);
        return -1;
    }
    struct vgpu_proc_slot *s = &R->procs[got];
    if (s->state == VGPU_SLOT_LIVE) { /* its owner died: return what it held */
        release_slot_locked(got);
        R->reclaimed_slots++;
    }
    s->pid = (int32_t)getpid();
    s->generation++;
    s->limits_source = params.limits_source;
    s->limits_dev = params.limits_dev;
    s->limits_ino = params.limits_ino;
    s->limits_hash = params.limits_hash;
    memset(s->used, 0, sizeof s->used);
    s->state = VGPU_SLOT_LIVE;
    if ((uint32_t)got >= R->slots_hwm) __atomic_store_n(&R->slots_hwm, (uint32_t)got + 1, __ATOMIC_RELEASE);
    vgpu_region_unlock();
    my_slot = got;
    pending_slot = -1;
    /* No dead-slot scan at this process's first allocations: with N processes of a slice
     * starting at once each scan is N byte-lock calls, on an inode whose lock list is N long.
     * A refusal still scans first, so a dead process's memory is back for the allocation that
     * needs it; the periodic scan resumes 100 ms after start. */
    last_scan_ns = now_ns();
    return 0;
}

static int ensure_slot(void) {
    if (__atomic_load_n(&my_slot, __ATOMIC_ACQUIRE) >= 0) return 0;
    if (region_broken) return -1;
    pthread_mutex_lock(&slot_mu);
    int rc = my_slot >= 0 ? 0 : claim_slot_locked_local();
    int e = errno;
    pthread_mutex_unlock(&slot_mu);
    if (rc == -1)
        vgpu_log(VGPU_LOG_ERROR, "no free process slot in the accounting file (max %d processes)", VGPU_MAX_PROCS);
    if (rc == -2) vgpu_log(VGPU_LOG_ERROR, "accounting file: byte locks unavailable (%s)", strerror(e));
    return rc;
}

void vgpu_region_reclaim_dead(void) {
    if (R == NULL) return;
    pthread_mutex_lock(&slot_mu);
    last_scan_ns = now_ns();
    uint32_t hwm = __atomic_load_n(&R->slots_hwm, __ATOMIC_ACQUIRE);
    if (hwm > VGPU_MAX_PROCS) hwm = VGPU_MAX_PROCS; /* never trust a shared counter as a bound */
    for (int i = 0; i < (int)hwm; i++) {
        /* never test our own slot: the lock is our own open file description's, so taking it
         * would succeed and unlocking it would drop our liveness */
        if (i == my_slot || __atomic_load_n(&R->procs[i].state, __ATOMIC_RELAXED) != VGPU_SLOT_LIVE) continue;
        if (byte_lock(region_fd, i, F_WRLCK) != 0) continue; /* owner alive (or a claimer) */
        if (vgpu_region_lock() == 0) {
            if (R->procs[i].state == VGPU_SLOT_LIVE) {
                release_slot_locked(i);
                R->reclaimed_slots++;
            }
            vgpu_region_unlock();
        }
        byte_lock(region_fd, i, F_UNLCK);
    }
    pthread_mutex_unlock(&slot_mu);
}

/* ---- opening ---- */

/* A new open file description of the file `fd` refers to (also for a memfd): through /proc, or
 * by path if the file there is still the same one. -1 with errno. */
static int reopen_same(int fd, const char *path) {
    /* by path first (cheapest), accepted only if it is still the same file */
    int nfd = path ? open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC) : -1;
    if (nfd >= 0) {
        struct stat a, b;
        if (vgpu_fstat(fd, &a) == 0 && vgpu_fstat(nfd, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
            return nfd;
        close(nfd); /* replaced meanwhile: go through /proc */
    }
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    return open(p, O_RDWR | O_CLOEXEC);
}

static CUresult open_fail(const char *path, const char *what, int err) {
    vgpu_log(VGPU_LOG_CONFIG, "accounting file %s (CUDA_DEVICE_MEMORY_SHARED_CACHE): %s%s%s; refusing to run unlimited",
             path, what, err ? ": " : "", err ? strerror(err) : "");
    return err ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_ERROR_INVALID_VALUE;
}

/* Open (creating it complete if absent) the accounting file at path, relative to its checked
 * directory, never through a link. -1 after the one line. */
static int open_path(const char *path, CUresult *err) {
    char base[NAME_MAX + 1], why[200];
    int dfd = vgpu_dir_open(path, base, sizeof base, why, sizeof why);
    if (dfd < 0) {
        *err = open_fail(path, why, 0);
        return -1;
    }
    int shared = 0;
    if (vgpu_dir_check(dfd, &shared, why, sizeof why) != 0) {
        close(dfd);
        *err = open_fail(path, why, 0);
        return -1;
    }
    /* /proc/<pid>/fd/<n> (how `vgpu run` shares a memfd region with CMD's children) is a kernel
     * link that nobody can plant: the one link that is followed. */
    struct statfs sfs;
    int nofollow = fstatfs(dfd, &sfs) == 0 && sfs.f_type == PROC_SUPER_MAGIC ? 0 : O_NOFOLLOW;
    int fd = -1;
    for (int attempt = 0; attempt < 3 && fd < 0; attempt++) {
        fd = openat(dfd, base, O_RDWR | nofollow | O_NONBLOCK | O_CLOEXEC);
        if (fd >= 0 || errno != ENOENT) break;
        if (create_atomically(dfd, base) != 0 && errno != EEXIST) {
            int e = errno;
            close(dfd);
            *err = open_fail(path, "cannot create", e);
            return -1;
        }
    }
    int e = errno;
    close(dfd);
    if (fd < 0) {
        *err = e == ELOOP || e == EISDIR ? open_fail(path, vgpu_open_error(e), 0)
                                         : open_fail(path, "cannot open read-write", e);
        return -1;
    }
    if (vgpu_file_check(fd, shared, why, sizeof why) != 0) {
        close(fd);
        *err = open_fail(path, why, 0);
        return -1;
    }
    return fd;
}

CUresult vgpu_region_open(const struct vgpu_region_params *p) {
    const char *path = p->path;
    const char *shown = path ? path : "(private)";
    CUresult rc = CUDA_SUCCESS; /* open_path's refusal, already logged */
    const char *bad = NULL;     /* or why we refuse, for open_fail's one line */
    int err = 0;                /* the errno behind `bad`, or 0 */
    char why[160];
    int fd = -1, lock_fd = -1;
    struct vgpu_region *r = MAP_FAILED;
    if (path == NULL) {
        fd = vgpu_memfd_create("vgpu-region", MFD_CLOEXEC);
        if (fd < 0) {
            bad = "cannot create";
            err = errno;
            goto fail;
        }
        if (fill_fd(fd) != 0) {
            bad = "cannot initialise";
            err = errno;
            goto fail;
        }
    } else {
        fd = open_path(path, &rc);
        if (fd < 0) goto fail;
    }
    struct stat st;
    if (vgpu_fstat(fd, &st) != 0) {
        bad = "cannot stat";
        err = errno;
        goto fail;
    }
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size != sizeof(struct vgpu_region)) {
        snprintf(why, sizeof why, "size %lld bytes, expected %zu (not a vgpu accounting file of layout %d)",
                 (long long)st.st_size, sizeof(struct vgpu_region), VGPU_REGION_LAYOUT_VERSION);
        bad = why;
        goto fail;
    }
    r = mmap(NULL, sizeof(struct vgpu_region), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) {
        bad = "cannot map";
        err = errno;
        goto fail;
    }
    if (r->header.magic != VGPU_REGION_MAGIC)
        bad = "wrong magic (not a vgpu accounting file)";
    else if (r->header.layout_version != VGPU_REGION_LAYOUT_VERSION) {
        snprintf(why, sizeof why, "layout version %u, this shim reads %d", r->header.layout_version,
                 VGPU_REGION_LAYOUT_VERSION);
        bad = why;
    } else if (r->header.file_size != sizeof *r || r->header.max_devices != VGPU_MAX_DEVICES ||
               r->header.max_procs != VGPU_MAX_PROCS)
        bad = "header sizes disagree with the layout";
    if (bad) goto fail;
    /* The slot lock must live on an open file description that only our descriptor refers to.
     * A mapping holds a reference to the description it was made from, and a fork child inherits
     * the mapping: had we locked through the mapping's description, a child would keep its
     * parent's slot alive. So the mapping keeps `fd`'s description (unlocked), and the locks go
     * through a second, fresh description of the same file. */
    lock_fd = reopen_same(fd, path);
    if (lock_fd < 0) {
        bad = "cannot open a second descriptor";
        err = errno;
        goto fail;
    }
    close(fd);
    fd = -1;
    params = *p;
    R = r;
    region_fd = lock_fd;
    pthread_mutex_lock(&slot_mu);
    int claimed = claim_slot_locked_local();
    err = errno;
    pthread_mutex_unlock(&slot_mu);
    if (claimed == 0) return CUDA_SUCCESS;
    R = NULL;
    region_fd = -1;
    if (claimed == -2)
        bad = "byte locks unavailable (it must be on a local filesystem)";
    else {
        snprintf(why, sizeof why, "all %d process slots are taken by live processes", VGPU_MAX_PROCS);
        bad = why;
        err = 0;
    }

fail: /* the one way out of a refusal: undo what was done, then say why in one line */
    if (r != MAP_FAILED) munmap(r, sizeof *r);
    if (lock_fd >= 0) close(lock_fd);
    if (fd >= 0) close(fd);
    return bad ? open_fail(shown, bad, err) : rc;
}

/* ---- charging ---- */

uint64_t vgpu_region_limit(int dev) { return params.limit[dev]; }

int vgpu_region_charge(int dev, uint64_t bytes, uint64_t limit, uint64_t *used_out) {
    if (ensure_slot() != 0) return -2;
    uint64_t t = now_ns();
    if (t - last_scan_ns > SCAN_INTERVAL_NS) vgpu_region_reclaim_dead();
    for (int attempt = 0;; attempt++) {
        if (vgpu_region_lock() != 0) return -2;
        struct vgpu_device_account *a = &R->devices[dev];
        uint64_t used = a->used;
        *used_out = used;
        if (limit != 0 && (bytes > limit || used > limit - bytes)) {
            if (attempt == 0) {
                /* before refusing, return dead processes' memory (at most one scan) */
                vgpu_region_unlock();
                vgpu_region_reclaim_dead();
                continue;
            }
            /* ... and check the total against the live slots: a critical section that overlapped
             * a takeover (a holder taken for hung, garbage in the word) may have stored a stale
             * total, which would otherwise refuse every allocation until the next takeover */
            uint64_t live = attempt == 1 ? used_by_live_locked(dev) : used;
            if (live != used) {
                __atomic_store_n(&a->used, live, __ATOMIC_RELAXED);
                vgpu_region_unlock();
                continue;
            }
            /* atomic: observers read these without the lock (region.h) */
            __atomic_fetch_add(&a->denials, 1, __ATOMIC_RELAXED);
            __atomic_fetch_add(&a->denied_bytes, bytes, __ATOMIC_RELAXED);
            vgpu_region_unlock();
            return -1;
        }
        __atomic_store_n(&a->used, used + bytes, __ATOMIC_RELAXED);
        R->procs[my_slot].used[dev] += bytes;
        if (used + bytes > a->peak) __atomic_store_n(&a->peak, used + bytes, __ATOMIC_RELAXED);
        vgpu_region_unlock();
        return 0;
    }
}

void vgpu_region_count_denial(int dev, uint64_t bytes) {
    if (R == NULL) return;
    __atomic_fetch_add(&R->devices[dev].denials, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&R->devices[dev].denied_bytes, bytes, __ATOMIC_RELAXED);
}

void vgpu_region_uncharge(int dev, uint64_t bytes) {
    if (my_slot < 0 || vgpu_region_lock() != 0) return;
    struct vgpu_device_account *a = &R->devices[dev];
    uint64_t *mine = &R->procs[my_slot].used[dev];
    /* clamp: never wrap (a fork child's frees of the parent's memory are not ours to return) */
    uint64_t b = bytes <= *mine ? bytes : *mine;
    *mine -= b;
    __atomic_store_n(&a->used, a->used >= b ? a->used - b : 0, __ATOMIC_RELAXED);
    vgpu_region_unlock();
}

/* ---- a context's learned size (protocol: region.h) ---- */

uint64_t vgpu_region_context(int dev, uint32_t *source) {
    if (R == NULL) {
        *source = VGPU_CONTEXT_UNKNOWN;
        return 0;
    }
    *source = __atomic_load_n(&R->devices[dev].context_source, __ATOMIC_ACQUIRE);
    return __atomic_load_n(&R->devices[dev].context_bytes, __ATOMIC_ACQUIRE);
}

static uint32_t *measurer_word(int dev) { return &R->devices[dev].context_measurer; }

int vgpu_region_context_claim(int dev, uint32_t *seen) {
    if (R == NULL || ensure_slot() != 0) return -1;
    uint32_t mine = (uint32_t)my_slot + 1, cur = __atomic_load_n(measurer_word(dev), __ATOMIC_ACQUIRE);
    for (;;) {
        /* free; ours (we are not measuring: a dead former owner of our slot); not a slot
         * (garbage); a slot nobody holds (its measurer died): ours to take */
        int take = cur == 0 || cur == mine || cur > VGPU_MAX_PROCS || slot_owned(cur - 1) == 0;
        if (!take) {
            *seen = cur;
            return 0;
        }
        if (__atomic_compare_exchange_n(measurer_word(dev), &cur, mine, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 1;
    }
}

void vgpu_region_context_wait(int dev, uint32_t seen, uint64_t ns) {
    if (R == NULL) return;
    struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    /* not FUTEX_PRIVATE: the word is in a shared file mapping, waited on by other processes */
    syscall(SYS_futex, measurer_word(dev), FUTEX_WAIT, seen, &ts, NULL, 0);
}

void vgpu_region_context_publish(int dev, uint64_t bytes, uint32_t source, uint64_t total, int claimed) {
    if (R == NULL) return;
    struct vgpu_device_account *a = &R->devices[dev];
    if (source != VGPU_CONTEXT_UNKNOWN && vgpu_region_lock() == 0) {
        uint32_t cur = a->context_source;
        uint64_t have = a->context_bytes;
        /* what is there is worth keeping only if it is a measurement and credible */
        int kept = (cur == VGPU_CONTEXT_DEVICE || cur == VGPU_CONTEXT_EXACT) && (total == 0 || have < total);
        int better = source == VGPU_CONTEXT_FAILED ? !kept && cur != VGPU_CONTEXT_FAILED
                                                   : !kept || source > cur || (source == cur && bytes < have);
        if (better) {
            __atomic_store_n(&a->context_bytes, bytes, __ATOMIC_RELEASE);
            __atomic_store_n(&a->context_source, source, __ATOMIC_RELEASE);
        }
        vgpu_region_unlock();
    }
    if (claimed) {
        uint32_t mine = (uint32_t)my_slot + 1;
        /* without a slot (the process is exiting) the claim is a dead slot's: woken, the
         * waiters take it over */
        if (my_slot >= 0)
            __atomic_compare_exchange_n(measurer_word(dev), &mine, 0, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
        syscall(SYS_futex, measurer_word(dev), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}

uint64_t vgpu_region_used(int dev) { return R ? __atomic_load_n(&R->devices[dev].used, __ATOMIC_RELAXED) : 0; }

uint64_t vgpu_region_mine(int dev) {
    return R && my_slot >= 0 ? __atomic_load_n(&R->procs[my_slot].used[dev], __ATOMIC_RELAXED) : UINT64_MAX;
}

void vgpu_region_atfork_child(void) {
    if (R == NULL) return;
    /* The inherited descriptor shares the parent's open file description and so its slot lock:
     * open a new description of the same file (works for memfd too) and claim a new slot later. */
    int fd = reopen_same(region_fd, params.path);
    close(region_fd);
    region_fd = fd;
    my_slot = -1;
    if (fd < 0) region_broken = 1;
    pthread_mutex_init(&slot_mu, NULL);
    pthread_mutex_init(&local_mu, NULL); /* held by another thread of the parent at fork */
}

/* Normal exit: give the slot back now rather than at the next scan (the driver frees the
 * process's memory as it exits). A killed process skips this; the byte lock covers that case. */
__attribute__((destructor)) static void region_at_exit(void) {
    if (R == NULL) return;
    void (*fn)(void) = __atomic_load_n(&on_exit_fn, __ATOMIC_ACQUIRE);
    if (fn != NULL) fn(); /* needs the slot */
    pthread_mutex_lock(&slot_mu);
    if (my_slot >= 0) {
        if (vgpu_region_lock() == 0) {
            release_slot_locked(my_slot);
            vgpu_region_unlock();
        }
        byte_lock(region_fd, my_slot, F_UNLCK);
        my_slot = -1;
    }
    pthread_mutex_unlock(&slot_mu);
}

/*
 * A context's own device memory, learned from the driver when the context is created (as
 * nvidia-smi shows it per process: a few hundred MiB on an H100 before any allocation). The
 * caller (context.c) reads the driver before and after creating the context and charges what
 * this file makes of the difference. Callers serialise: one context creation at a time per
 * process (the readings of two overlapping creations would each count both contexts).
 *
 * Sources, best first (NVML is the driver's own accounting, and needs no context to ask):
 *  1. This process's used memory in NVML's process list: exact, and blind to other processes.
 *     NVML lists host PIDs, so in a container our getpid() is not what NVML lists. Our host PID
 *     is getpid() only in the initial PID namespace; elsewhere it is the one PID that appears in
 *     the device's list across our first context on that device (nothing of ours was there
 *     before; two new PIDs, another process's first context at the same moment, is ambiguous
 *     and teaches nothing). Learned once per process.
 *  2. The device's used memory (nvmlDeviceGetMemoryInfo) before and after: includes what other
 *     processes allocated or freed meanwhile. Other processes' allocations make it too large, so
 *     the smallest such measurement of the device in this process is used from then on;
 *     their frees could make it too small, which VGPU_CONTEXT_RESERVE bounds from below.
 * A measurement is credible when it is more than 0 and less than the device's memory. Whatever
 * is measured, a context is charged at least VGPU_CONTEXT_RESERVE (the admin's floor), and when
 * nothing credible is measured, the last credible measurement of the device in this process.
 *
 * Learned once per slice: loading NVML and reading it costs ~0.7 ms of CPU (more on real
 * hardware, whose nvmlInit is slow), most of a process's start-up under the shim. So the size is
 * kept in the slice's accounting file (devices[].context_bytes, region.h) and a process whose
 * slice knows it charges that, reserved before the context is created, and never loads NVML.
 * Only a process that finds nothing learned measures, after claiming the measurement for the
 * slice; processes starting meanwhile wait for its publication (woken by it) as long as the
 * measurer lives, so of N processes starting at once in a fresh slice one measures, and none
 * creates a context before it is admitted: the measurer publishes only once its own context is
 * charged (or destroyed), vgpu_ctxmem_done. A size handed over (VGPU_CONTEXT_SIZE) spares the
 * measurer the measurement on its start-up path: see the verifier below.
 * Published: an exact measurement over one from the device's used memory, the smaller of two of
 * one kind; "NVML said nothing" only where nothing credible is known (then each process tries).
 * The file is the tenant's: a learned size is charged at least VGPU_CONTEXT_RESERVE (from the
 * read-only limits file) and is measured again when it is not below the device's memory, as the
 * driver reports it (cuDeviceTotalMem). Lowering it cheats only the tenant's own quota, as
 * rewriting its usage counters would; the watchdog's NVML check is the backstop (docs/shim.md).
 */
#define _GNU_SOURCE /* SCHED_BATCH */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ctxmem.h"
#include "config.h"
#include "log.h"
#include "region.h"
#include "symbols.h"
#include "settings.h"

/* The initial PID namespace's inode (PROC_PID_INIT_INO, include/linux/proc_ns.h). */
#define PID_NS_INIT       "pid:[4026531836]"
#define MAX_PROCS         1024
#define LEARN_WAIT_NS     2000000000ULL /* a wait for another process's measurement this long is logged */
#define VERIFY_AT_EXIT_NS 500000000ULL  /* the longest an exit waits for a verification under way */
#define LEARN_POLL_NS     10000000ULL   /* between looks at whether that process is still alive */

typedef nvmlReturn_t (*pfn_init)(void);
typedef nvmlReturn_t (*pfn_by_uuid)(const char *, nvmlDevice_t *);
typedef nvmlReturn_t (*pfn_meminfo)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*pfn_procs)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *);
typedef CUresult (*pfn_uuid)(CUuuid *, CUdevice);

static struct {
    int tried, ok;
    pfn_by_uuid by_uuid;
    pfn_meminfo meminfo;
    pfn_procs procs;
} nv;

static int nvdev_state[VGPU_MAX_DEVICES]; /* 0 not tried, 1 handle found, -1 none */
static nvmlDevice_t nvdev[VGPU_MAX_DEVICES];
static uint64_t memo[VGPU_MAX_DEVICES];  /* the smallest credible measurement, 0 none */
static int memo_exact[VGPU_MAX_DEVICES]; /* memo came from our own process entry */
static unsigned host_pid;                /* ours as NVML lists it, 0 unknown */
static pid_t host_pid_of;                /* the getpid() it was learned in (a fork child relearns) */
static int warned[VGPU_MAX_DEVICES];
static nvmlProcessInfo_t procs_buf[MAX_PROCS]; /* callers serialise */
static int start_verifier(struct vgpu_ctxmem_probe *p, CUdevice cudev);

static int nvml_ready(void) {
    if (!nv.tried) {
        nv.tried = 1;
        pfn_init init = (pfn_init)vgpu_nvml_sym("nvmlInit_v2");
        nv.by_uuid = (pfn_by_uuid)vgpu_nvml_sym("nvmlDeviceGetHandleByUUID");
        nv.meminfo = (pfn_meminfo)vgpu_nvml_sym("nvmlDeviceGetMemoryInfo");
        nv.procs = (pfn_procs)vgpu_nvml_sym("nvmlDeviceGetComputeRunningProcesses_v3");
        /* initialised once and never shut down: NVML counts, so the program's own
         * nvmlShutdown does not pull it from under us */
        nv.ok = init != NULL && nv.by_uuid != NULL && nv.meminfo != NULL && init() == NVML_SUCCESS;
    }
    return nv.ok;
}

static int device_handle(int dev, CUdevice cudev) {
    if (!nvml_ready()) return 0;
    if (nvdev_state[dev] == 0) {
        pfn_uuid get_uuid = (pfn_uuid)vgpu_cuda_sym("cuDeviceGetUuid_v2");
        if (get_uuid == NULL) get_uuid = (pfn_uuid)vgpu_cuda_sym("cuDeviceGetUuid");
        CUuuid u;
        char s[48];
        nvdev_state[dev] = -1;
        if (get_uuid != NULL && get_uuid(&u, cudev) == CUDA_SUCCESS) {
            const unsigned char *b = (const unsigned char *)u.bytes;
            snprintf(s, sizeof s, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                     b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
            if (nv.by_uuid(s, &nvdev[dev]) == NVML_SUCCESS) nvdev_state[dev] = 1;
        }
    }
    return nvdev_state[dev] > 0;
}

/* The device's process list into buf (MAX_PROCS entries): the count, or -1. */
static int read_procs_into(int dev, nvmlProcessInfo_t *buf) {
    if (nv.procs == NULL) return -1;
    unsigned int n = MAX_PROCS;
    if (nv.procs(nvdev[dev], &n, buf) != NVML_SUCCESS || n > MAX_PROCS) return -1;
    return (int)n;
}

static int read_procs(int dev) { return read_procs_into(dev, procs_buf); }

static unsigned known_host_pid(void) {
    if (host_pid != 0 && host_pid_of == getpid()) return host_pid;
    host_pid = 0;
    char ns[64];
    ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    if (n > 0) {
        ns[n] = '\0';
        if (strcmp(ns, PID_NS_INIT) == 0) {
            host_pid = (unsigned)getpid();
            host_pid_of = getpid();
        }
    }
    return host_pid;
}

/* Our entry's used memory in buf[0..n): 1 found (*used set), 0 not listed, -1 not reported. */
static int self_used_in(const nvmlProcessInfo_t *buf, int n, unsigned pid, uint64_t *used) {
    for (int i = 0; i < n; i++) {
        if (buf[i].pid != pid) continue;
        if (buf[i].usedGpuMemory == (unsigned long long)NVML_VALUE_NOT_AVAILABLE) return -1;
        *used = buf[i].usedGpuMemory;
        return 1;
    }
    return 0;
}

static int self_used(int n, unsigned pid, uint64_t *used) { return self_used_in(procs_buf, n, pid, used); }

void vgpu_ctxmem_before(struct vgpu_ctxmem_probe *p, CUdevice cudev, int first_on_device) {
    int dev = p->dev;
    p->first = first_on_device;
    if (p->plugin) return; /* the plugin measured it: nothing to read */
    if (p->hinted) {
        if (start_verifier(p, cudev)) return;
        p->hinted = 0; /* no thread: measured here, the handed-over size only reserved */
    }
    if (!device_handle(dev, cudev)) return;
    nvmlMemory_t m;
    if (nv.meminfo(nvdev[dev], &m) == NVML_SUCCESS) {
        p->have_dev = 1;
        p->dev_used = m.used;
        p->total = m.total;
    }
    int n = read_procs(dev);
    if (n < 0) return;
    unsigned self = known_host_pid();
    if (self != 0) {
        uint64_t u = 0;
        int r = self_used(n, self, &u);
        p->have_self = r >= 0;
        p->self_used = r > 0 ? u : 0;
    } else if (first_on_device) {
        /* remember who was listed, to find our PID as the one that appears */
        p->npids = (unsigned)n < VGPU_CTXMEM_PIDS ? (unsigned)n : 0;
        p->have_pids = (unsigned)n < VGPU_CTXMEM_PIDS;
        for (unsigned i = 0; i < p->npids; i++) p->pids[i] = procs_buf[i].pid;
    }
}

/* Our host PID from the list (buf[0..n)) after our first context on the device, given the PIDs
 * listed before it (pids[0..npids)): the one new PID, or 0. */
static unsigned find_new_pid_in(const unsigned *pids, unsigned npids, const nvmlProcessInfo_t *buf, int n) {
    unsigned found = 0;
    for (int i = 0; i < n; i++) {
        unsigned pid = buf[i].pid;
        int old = 0;
        for (unsigned j = 0; j < npids && !old; j++) old = pids[j] == pid;
        if (old) continue;
        if (found != 0 && found != pid) return 0; /* two appeared: ambiguous */
        found = pid;
    }
    return found;
}

static unsigned find_new_pid(const struct vgpu_ctxmem_probe *p, int n) {
    return find_new_pid_in(p->pids, p->npids, procs_buf, n);
}

/* What the context just created took, and from where; 0 with *src "nothing" when nothing credible
 * was measured (an exact 0, a context that takes nothing, is a measurement). */
static uint64_t measure(struct vgpu_ctxmem_probe *p, const char **src) {
    *src = "nothing";
    p->exact = 0;
    int dev = p->dev;
    if (nvdev_state[dev] <= 0) return 0;
    int n = read_procs(dev);
    unsigned self = known_host_pid();
    if (n >= 0 && self == 0 && p->first && p->have_pids) {
        self = find_new_pid(p, n);
        if (self != 0) {
            host_pid = self;
            host_pid_of = getpid();
            p->have_self = 1; /* not listed before: nothing of ours was there */
            p->self_used = 0;
        }
    }
    uint64_t m = 0, after = 0;
    if (n >= 0 && self != 0 && p->have_self && self_used(n, self, &after) > 0) {
        *src = "this process's NVML entry";
        m = after > p->self_used ? after - p->self_used : 0;
        p->exact = 1;
    } else if (p->have_dev) {
        nvmlMemory_t mi;
        if (nv.meminfo(nvdev[dev], &mi) == NVML_SUCCESS && mi.used > p->dev_used) {
            *src = "the device's used memory";
            m = mi.used - p->dev_used;
        }
    }
    if ((m == 0 && !p->exact) || (p->total != 0 && m >= p->total)) {
        *src = "nothing";
        p->exact = 0;
        return 0;
    }
    return m;
}

/* A context that exists already (retained out of the shim's sight, context.c): what it takes,
 * from this process's NVML entry less what the process has charged on the device, 0 when that
 * cannot tell (our host PID unknown, no entry). p comes from vgpu_ctxmem_expect, not learned;
 * a measurement is what vgpu_ctxmem_done then publishes. */
uint64_t vgpu_ctxmem_existing(struct vgpu_ctxmem_probe *p, CUdevice cudev) {
    int dev = p->dev;
    if (p->plugin) return 0; /* the plugin's size (vgpu_ctxmem_expect's) is charged */
    p->hinted = 0;           /* measured here: no verifier */
    unsigned self = known_host_pid();
    if (self == 0 || !device_handle(dev, cudev)) return 0;
    uint64_t used = 0, mine = vgpu_region_mine(dev);
    int n = read_procs(dev);
    if (n < 0 || mine == UINT64_MAX || self_used(n, self, &used) <= 0) return 0;
    uint64_t m = used > mine ? used - mine : 0;
    if (m == 0 || (p->cuda_total != 0 && m >= p->cuda_total)) return 0;
    memo[dev] = m;
    memo_exact[dev] = 1;
    p->pub_source = VGPU_CONTEXT_EXACT;
    p->pub_bytes = m;
    return m;
}

/* ---- a handed-over size (VGPU_CONTEXT_SIZE), verified against the driver off the start-up path ----
 * The slice's first process charges the handed-over size for its context before creating it, and
 * a thread of its own then measures the context through NVML (this process's entry) while the
 * program goes on: loading and reading NVML is most of what a first process would otherwise add
 * to its start-up. The context's charge then settles on the driver's figure, down as well as up
 * (the caller's settle function moves its record of the context with it, so its destruction
 * returns what it is charged): a hint is a guess (a cache from another program, whose context
 * took more: lazy loading, limits it set), the driver's figure is what the context takes, 0
 * included. One too small is made up at once (charged even past the quota: the context exists,
 * and the slice then refuses allocations until it is back under); one too large is given back,
 * and an allocation refused meanwhile waits for the verification and is retried
 * (vgpu_ctxmem_wait_verified). A figure below the charge is read twice and the larger taken: an
 * allocation of the program between its charge and the driver's answer, or a free between the
 * driver's and the uncharge, reads low once. The slice's other processes wait for the verified
 * size, as for any measurement, so a wrong size is charged at most for this one context. Our
 * host PID: getpid() in the initial PID namespace; in another, the one PID that appears across
 * the context's creation, which needs the list before it, read on the caller's thread (the
 * start-up then pays that reading, not the rest). */
static struct {
    int dev;
    CUdevice cudev;
    uint64_t charged, cuda_total;
    unsigned self; /* our host PID if known before creation */
    int have_pids;
    unsigned npids, pids[VGPU_CTXMEM_PIDS];
    int created; /* futex word: 0 pending, 1 the context exists and is charged, -1 not created */
    int (*settle)(int dev, uint64_t key, uint64_t from, uint64_t to);
    uint64_t key;
    int gave_back; /* the verification gave charge back */
} vjob;
/* futex word: a verifier thread owns vjob, the slice's claim and the NVML state (futexes, not
 * condition variables: those are libpthread's before glibc 2.34, which the shim does not need) */
static int verifying;
static pthread_once_t vfork_once = PTHREAD_ONCE_INIT;

static void word_set(int *w, int v) {
    __atomic_store_n(w, v, __ATOMIC_RELEASE);
    syscall(SYS_futex, w, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Wait while *w == v, at most until the CLOCK_MONOTONIC deadline (ns; 0: none). */
static void word_wait(int *w, int v, uint64_t deadline) {
    while (__atomic_load_n(w, __ATOMIC_ACQUIRE) == v) {
        struct timespec rel, *t = NULL;
        if (deadline != 0) {
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            uint64_t n = (uint64_t)now.tv_sec * 1000000000ULL + (uint64_t)now.tv_nsec;
            if (n >= deadline) return;
            rel.tv_sec = (time_t)((deadline - n) / 1000000000ULL);
            rel.tv_nsec = (long)((deadline - n) % 1000000000ULL);
            t = &rel;
        }
        syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, v, t, NULL, 0);
    }
}

static void verifier_atfork_child(void) {
    /* the thread does not survive the fork; the claim is its parent's (slot) and dies with it */
    verifying = 0;
}
static void verifier_at_exit(void);

/* Once, before the first verification: a fork child has none, and a normal exit concludes one. */
static void verifier_register(void) {
    pthread_atfork(NULL, NULL, verifier_atfork_child);
    vgpu_region_on_exit(verifier_at_exit);
}

static void wait_verifier(void) { word_wait(&verifying, 1, 0); }

int vgpu_ctxmem_wait_verified(int dev) {
    /* only past the context's creation: before it, the verifier waits for the caller, which may
     * be this very thread */
    if (!__atomic_load_n(&verifying, __ATOMIC_ACQUIRE) || __atomic_load_n(&vjob.created, __ATOMIC_ACQUIRE) <= 0 ||
        vjob.dev != dev)
        return 0;
    wait_verifier();
    return __atomic_load_n(&vjob.gave_back, __ATOMIC_ACQUIRE);
}

/* What this process's entry says the context takes (*m): our entry's used memory less what else
 * the process has charged on the device (its allocations since; re-read if they moved
 * meanwhile). 1 measured (0 is a figure: a context that takes nothing), 0 when it cannot tell. */
static int verify_measure(nvmlProcessInfo_t *buf, uint64_t *m) {
    int dev = vjob.dev, ok = 0;
    if (!device_handle(dev, vjob.cudev)) return 0;
    /* a program allocating as it starts moves its charge between readings: a few more tries (a
     * refused allocation waits for this thread, and then its charge stands still) */
    for (int attempt = 0; attempt < 10 && !ok; attempt++) {
        uint64_t mine = vgpu_region_mine(dev);
        if (mine == UINT64_MAX) break; /* exiting: its charges are gone already */
        int n = read_procs_into(dev, buf);
        if (n < 0) break;
        unsigned self = vjob.self;
        if (self == 0 && vjob.have_pids) self = find_new_pid_in(vjob.pids, vjob.npids, buf, n);
        uint64_t used = 0;
        if (self == 0 || self_used_in(buf, n, self, &used) <= 0) break;
        if (vgpu_region_mine(dev) != mine) continue;
        if (vjob.self == 0) {
            host_pid = self;
            host_pid_of = getpid();
        }
        uint64_t others = mine > vjob.charged ? mine - vjob.charged : 0;
        *m = used > others ? used - others : 0;
        ok = vjob.cuda_total == 0 || *m < vjob.cuda_total;
        if (!ok) break; /* not credible: nothing */
    }
    return ok;
}

static void *verifier(void *arg) {
    (void)arg;
    /* Woken when the context exists, it must not preempt the program's thread that woke it
     * (SCHED_BATCH: no wakeup preemption, a fair share otherwise: the slice's other processes
     * may be waiting for it). NVML is loaded while the driver creates the context. */
    struct sched_param sp = {0};
    sched_setscheduler(0, SCHED_BATCH, &sp); /* 0: this thread */
    device_handle(vjob.dev, vjob.cudev);
    word_wait(&vjob.created, 0, 0);
    int created = __atomic_load_n(&vjob.created, __ATOMIC_ACQUIRE);
    int dev = vjob.dev;
    if (created > 0) {
        static nvmlProcessInfo_t buf[MAX_PROCS]; /* one verifier at a time */
        uint64_t m = 0, again = 0;
        int ok = verify_measure(buf, &m);
        /* below the charge: read again, the larger wins (a reading low by an allocation in flight) */
        if (ok && m < vjob.charged) ok = verify_measure(buf, &again);
        if (ok && again > m) m = again;
        char a[32], b[32];
        vgpu_format_bytes(m, a, sizeof a);
        vgpu_format_bytes(vjob.charged, b, sizeof b);
        if (!ok) {
            vgpu_log(VGPU_LOG_DEBUG, "context on device %d: charged %s (VGPU_CONTEXT_SIZE); NVML could not verify it",
                     dev, b);
            vgpu_region_context_publish(dev, 0, VGPU_CONTEXT_UNKNOWN, 0, 1); /* the next process tries */
        } else {
            /* the context's charge moves to the driver's figure (never below the admin's floor),
             * with its record (if it still exists: one destroyed meanwhile returned what it was
             * charged) */
            uint64_t floor = vgpu_config()->context_reserve, to = m > floor ? m : floor;
            int moved = to != vjob.charged && vjob.settle != NULL && vjob.settle(dev, vjob.key, vjob.charged, to);
            char t[32];
            vgpu_format_bytes(to, t, sizeof t);
            if (to > vjob.charged)
                vgpu_log(VGPU_LOG_WARN,
                         "context on device %d: the driver took %s, more than VGPU_CONTEXT_SIZE (%s): charging %s%s",
                         dev, a, b, t, moved ? "" : " (the context is gone)");
            else if (to < vjob.charged)
                vgpu_log(VGPU_LOG_DEBUG,
                         "context on device %d: the driver took %s, less than VGPU_CONTEXT_SIZE (%s): charging %s%s",
                         dev, a, b, t, moved ? "" : " (the context is gone)");
            else
                vgpu_log(VGPU_LOG_DEBUG,
                         "context on device %d: charged %s (VGPU_CONTEXT_SIZE); %s measured from this "
                         "process's NVML entry",
                         dev, b, a);
            __atomic_store_n(&vjob.gave_back, moved && to < vjob.charged, __ATOMIC_RELEASE);
            memo[dev] = m;
            memo_exact[dev] = 1;
            vgpu_region_context_publish(dev, m, VGPU_CONTEXT_EXACT, vjob.cuda_total, 1);
        }
    } else {
        vgpu_region_context_publish(dev, 0, VGPU_CONTEXT_UNKNOWN, 0, 1);
    }
    word_set(&verifying, 0);
    return NULL;
}

/* Before the context is created, p->charge reserved: hand the measurement to a thread. 0 when
 * there is none (the caller then measures here, as without a handed-over size). */
static int start_verifier(struct vgpu_ctxmem_probe *p, CUdevice cudev) {
    pthread_once(&vfork_once, verifier_register);
    vjob.dev = p->dev;
    vjob.cudev = cudev;
    vjob.charged = p->charge;
    vjob.cuda_total = p->cuda_total;
    vjob.settle = NULL; /* the caller's, at vgpu_ctxmem_done */
    vjob.key = 0;
    vjob.gave_back = 0;
    __atomic_store_n(&vjob.created, 0, __ATOMIC_RELAXED);
    vjob.self = known_host_pid();
    vjob.have_pids = 0;
    vjob.npids = 0;
    if (vjob.self == 0 && device_handle(p->dev, cudev)) {
        int n = read_procs(p->dev);
        if (n >= 0 && n < VGPU_CTXMEM_PIDS) {
            vjob.have_pids = 1;
            vjob.npids = (unsigned)n;
            for (int i = 0; i < n; i++) vjob.pids[i] = procs_buf[i].pid;
        }
    }
    pthread_attr_t a;
    pthread_t t;
    if (pthread_attr_init(&a) != 0) return 0;
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 256 * 1024);
    __atomic_store_n(&verifying, 1, __ATOMIC_RELEASE);
    int ok = pthread_create(&t, &a, verifier, NULL) == 0;
    pthread_attr_destroy(&a);
    if (!ok) word_set(&verifying, 0);
    return ok;
}

/* At a normal exit, before the slot is given back (region.c runs it): conclude (briefly) or drop
 * a verification of a handed-over size that is under way. */
static void verifier_at_exit(void) {
    if (!__atomic_load_n(&verifying, __ATOMIC_ACQUIRE)) return;
    /* A verification under way dies with the process: let it conclude first (what measuring
     * in place would have cost, paid at exit instead of at start-up; a process that exits this
     * soon after its first context is rare outside benchmarks), so that the slice's waiting
     * processes get the size rather than each repeating the verification. */
    if (__atomic_load_n(&vjob.created, __ATOMIC_ACQUIRE) > 0) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        word_wait(&verifying, 1, (uint64_t)now.tv_sec * 1000000000ULL + (uint64_t)now.tv_nsec + VERIFY_AT_EXIT_NS);
    }
    int left = __atomic_load_n(&verifying, __ATOMIC_ACQUIRE);
    /* not concluded (never created, or too slow): drop the claim and wake the waiters now */
    if (left) vgpu_region_context_publish(vjob.dev, 0, VGPU_CONTEXT_UNKNOWN, 0, 1);
}

/* The hinted context was created and charged (created 1) or not (-1): the verifier goes on. */
static void verifier_go(struct vgpu_ctxmem_probe *p, int created) {
    vjob.settle = p->settle; /* published to the verifier by the release store below */
    vjob.key = p->key;
    word_set(&vjob.created, created);
    p->hinted = 0;
    p->claimed = 0; /* the verifier publishes and drops the claim */
}

/* VGPU_CONTEXT_SIZE of device index dev when credible (less than the device's memory, total;
 * 0 unknown), else 0. */
static uint64_t handed_over(int dev, uint64_t total) {
    uint64_t h = vgpu_config()->context_size[dev];
    return total == 0 || h < total ? h : 0;
}

static uint64_t estimate(int dev, uint64_t total) {
    uint64_t e = vgpu_config()->context_reserve, h = handed_over(dev, total);
    if (memo[dev] > e) e = memo[dev];
    return h > e ? h : e;
}

/* The device's memory as the driver reports it without NVML (0 unknown): the learned size's
 * upper bound. */
static uint64_t cuda_total(CUdevice cudev) {
    size_t t = 0;
    if (real_cuDeviceTotalMem_v2 == NULL || real_cuDeviceTotalMem_v2(&t, cudev) != CUDA_SUCCESS) return 0;
    return (uint64_t)t;
}

uint64_t vgpu_ctxmem_expect(struct vgpu_ctxmem_probe *p, int dev, CUdevice cudev) {
    wait_verifier(); /* this process's NVML readings are the verifier's until it is done */
    memset(p, 0, sizeof *p);
    p->dev = dev;
    p->cuda_total = cuda_total(cudev);
    uint64_t start = 0;
    int said = 0;
    for (;;) {
        uint32_t src, seen = 0;
        uint64_t v = vgpu_region_context(dev, &src);
        /* credible: measured, and less than the device (a tenant's garbage is measured again) */
        if ((src == VGPU_CONTEXT_DEVICE || src == VGPU_CONTEXT_EXACT) && (p->cuda_total == 0 || v < p->cuda_total)) {
            uint64_t floor = vgpu_config()->context_reserve;
            vgpu_ctxmem_cancel(p); /* published between our look and our claim */
            p->learned = 1;
            p->charge = v > floor ? v : floor;
            return p->charge;
        }
        /* NVML said nothing to another process: try ourselves */
        if (p->claimed || src == VGPU_CONTEXT_FAILED) break;
        int c = vgpu_region_context_claim(dev, &seen);
        if (c < 0) break;
        if (c > 0) {
            p->claimed = 1; /* look once more: the last measurer may have published meanwhile */
            continue;
        }
        /* Another process of the slice is measuring it: its context exists and is charged only
         * once measured, so none may be created before that (it would be admitted against a
         * quota that does not count the measurer's yet). Wait as long as the measurer lives (a
         * dead one's claim is taken over above); a context's creation takes tens to hundreds of
         * ms on real GPUs, seconds when the driver first brings a GPU up. */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t now = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
        if (start == 0) start = now;
        if (!said && now - start > LEARN_WAIT_NS) {
            said = 1;
            vgpu_log(VGPU_LOG_INFO,
                     "context on device %d: waiting for slot %u of the slice to measure a context (over %d ms)", dev,
                     seen - 1, (int)(LEARN_WAIT_NS / 1000000));
        }
        vgpu_region_context_wait(dev, seen, LEARN_POLL_NS); /* woken at its publication */
    }
    uint64_t h = handed_over(dev, p->cuda_total);
    if (h != 0 && vgpu_settings_file() != NULL && !vgpu_config()->disabled) {
        /* The plugin's size (VGPU_CONTEXT_SIZE_<i> of its read-only limits file): the plugin
         * measured a context of this GPU model and driver itself, so it is charged as a learned
         * size would be and published for the slice (when this process claimed the measurement),
         * without loading NVML: the slice's first process starts as its later ones do. */
        uint64_t floor = vgpu_config()->context_reserve;
        p->plugin = 1;
        p->charge = h > floor ? h : floor;
        p->pub_source = VGPU_CONTEXT_EXACT;
        p->pub_bytes = h;
        return p->charge;
    }
    uint64_t e = estimate(dev, p->cuda_total);
    /* measuring for the slice with a size handed over: that is charged before the context is
     * created and verified against the driver off the start-up path (start_verifier) */
    p->hinted = p->claimed && handed_over(dev, p->cuda_total) != 0 && !vgpu_config()->disabled;
    if (p->hinted) p->charge = e;
    return e;
}

void vgpu_ctxmem_cancel(struct vgpu_ctxmem_probe *p) {
    if (p->hinted) {
        verifier_go(p, -1);
        return;
    }
    if (p->claimed) vgpu_region_context_publish(p->dev, 0, VGPU_CONTEXT_UNKNOWN, 0, 1);
    p->claimed = 0;
}

uint64_t vgpu_ctxmem_after(struct vgpu_ctxmem_probe *p) {
    int dev = p->dev;
    char a[32], b[32];
    if (p->plugin) {
        vgpu_format_bytes(p->charge, b, sizeof b);
        vgpu_log(VGPU_LOG_DEBUG, "context on device %d: charged %s, the plugin's VGPU_CONTEXT_SIZE_%d (NVML not asked)",
                 dev, b, dev);
        return p->charge;
    }
    if (p->learned || p->hinted) {
        if (p->hinted) return p->charge; /* the verifier says what it was */
        vgpu_format_bytes(p->charge, b, sizeof b);
        vgpu_log(VGPU_LOG_DEBUG, "context on device %d: charged %s, the size the slice learned (NVML not asked)", dev,
                 b);
        return p->charge;
    }
    const char *src;
    uint64_t m = measure(p, &src);
    if (p->exact) {
        memo[dev] = m;
        memo_exact[dev] = 1;
    } else if (m != 0 && !memo_exact[dev]) {
        /* a device-wide reading may include others' allocations: the smallest one wins */
        if (memo[dev] != 0 && memo[dev] < m) m = memo[dev];
        memo[dev] = m;
    } else {
        m = memo[dev]; /* nothing credible, or an exact measurement is known: that one */
    }
    uint64_t floor = vgpu_config()->context_reserve, charge = m > floor ? m : floor;
    /* what this process now takes a context on dev for, for the slice's later processes */
    p->pub_source = memo_exact[dev] ? VGPU_CONTEXT_EXACT : m != 0 ? VGPU_CONTEXT_DEVICE : VGPU_CONTEXT_FAILED;
    p->pub_bytes = m;
    vgpu_format_bytes(m, a, sizeof a);
    vgpu_format_bytes(charge, b, sizeof b);
    vgpu_log(VGPU_LOG_DEBUG, "context on device %d: %s measured from %s; charged %s", dev, a, src, b);
    if (m == 0 && !memo_exact[dev] && !warned[dev]) {
        warned[dev] = 1;
        vgpu_log(VGPU_LOG_INFO,
                 "the device memory of a context on device %d could not be measured (NVML does not say); "
                 "charging VGPU_CONTEXT_RESERVE (%s) per context",
                 dev, b);
    }
    return charge;
}

void vgpu_ctxmem_done(struct vgpu_ctxmem_probe *p) {
    if (p->hinted) {
        verifier_go(p, 1);
        return;
    }
    if (p->plugin && !p->claimed) return; /* another process of the slice measures or has published */
    if (p->learned || p->pub_source == VGPU_CONTEXT_UNKNOWN) {
        vgpu_ctxmem_cancel(p); /* nothing measured: the claim (if any) goes to the next process */
        return;
    }
    vgpu_region_context_publish(p->dev, p->pub_bytes, p->pub_source, p->cuda_total, p->claimed);
    p->claimed = 0;
    p->pub_source = VGPU_CONTEXT_UNKNOWN;
}

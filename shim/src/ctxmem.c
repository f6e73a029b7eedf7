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
 * slice; processes starting meanwhile wait for its publication (woken by it; at most 2 s, then
 * they measure themselves), so of N processes starting at once in a fresh slice one measures.
 * Published: an exact measurement over one from the device's used memory, the smaller of two of
 * one kind; "NVML said nothing" only where nothing credible is known (then each process tries).
 * The file is the tenant's: a learned size is charged at least VGPU_CONTEXT_RESERVE (from the
 * read-only limits file) and is measured again when it is not below the device's memory, as the
 * driver reports it (cuDeviceTotalMem). Lowering it cheats only the tenant's own quota, as
 * rewriting its usage counters would; the watchdog's NVML check is the backstop (docs/shim.md).
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shim_internal.h"

/* The initial PID namespace's inode (PROC_PID_INIT_INO, include/linux/proc_ns.h). */
#define PID_NS_INIT "pid:[4026531836]"
#define MAX_PROCS 1024
#define LEARN_WAIT_NS 2000000000ULL /* a wait for another process's measurement this long is logged */
#define LEARN_POLL_NS 10000000ULL   /* between looks at whether that process is still alive */

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
static uint64_t memo[VGPU_MAX_DEVICES];   /* the smallest credible measurement, 0 none */
static int memo_exact[VGPU_MAX_DEVICES];  /* memo came from our own process entry */
static unsigned host_pid;                 /* ours as NVML lists it, 0 unknown */
static pid_t host_pid_of;                 /* the getpid() it was learned in (a fork child relearns) */
static int warned[VGPU_MAX_DEVICES];
static nvmlProcessInfo_t procs_buf[MAX_PROCS]; /* callers serialise */

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
            snprintf(s, sizeof s, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                     b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                     b[14], b[15]);
            if (nv.by_uuid(s, &nvdev[dev]) == NVML_SUCCESS) nvdev_state[dev] = 1;
        }
    }
    return nvdev_state[dev] > 0;
}

/* The device's process list into procs_buf: the count, or -1. */
static int read_procs(int dev) {
    if (nv.procs == NULL) return -1;
    unsigned int n = MAX_PROCS;
    if (nv.procs(nvdev[dev], &n, procs_buf) != NVML_SUCCESS || n > MAX_PROCS) return -1;
    return (int)n;
}

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

/* Our entry's used memory in procs_buf[0..n): 1 found (*used set), 0 not listed, -1 not reported. */
static int self_used(int n, unsigned pid, uint64_t *used) {
    for (int i = 0; i < n; i++) {
        if (procs_buf[i].pid != pid) continue;
        if (procs_buf[i].usedGpuMemory == (unsigned long long)NVML_VALUE_NOT_AVAILABLE) return -1;
        *used = procs_buf[i].usedGpuMemory;
        return 1;
    }
    return 0;
}

void vgpu_ctxmem_before(struct vgpu_ctxmem_probe *p, CUdevice cudev, int first_on_device) {
    int dev = p->dev;
    p->first = first_on_device;
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

/* Our host PID from the list after our first context on the device: the one new PID, or 0. */
static unsigned find_new_pid(const struct vgpu_ctxmem_probe *p, int n) {
    unsigned found = 0;
    for (int i = 0; i < n; i++) {
        unsigned pid = procs_buf[i].pid;
        int old = 0;
        for (unsigned j = 0; j < p->npids && !old; j++) old = p->pids[j] == pid;
        if (old) continue;
        if (found != 0 && found != pid) return 0; /* two appeared: ambiguous */
        found = pid;
    }
    return found;
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

static uint64_t estimate(int dev) {
    uint64_t floor = vgpu_config()->context_reserve;
    return memo[dev] > floor ? memo[dev] : floor;
}

/* The device's memory as the driver reports it without NVML (0 unknown): the learned size's
 * upper bound. */
static uint64_t cuda_total(CUdevice cudev) {
    size_t t = 0;
    if (real_cuDeviceTotalMem_v2 == NULL || real_cuDeviceTotalMem_v2(&t, cudev) != CUDA_SUCCESS) return 0;
    return (uint64_t)t;
}

uint64_t vgpu_ctxmem_expect(struct vgpu_ctxmem_probe *p, int dev, CUdevice cudev) {
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
            vgpu_log(VGPU_LOG_INFO, "context on device %d: waiting for slot %u of the slice to measure a context (over %d ms)",
                     dev, seen - 1, (int)(LEARN_WAIT_NS / 1000000));
        }
        vgpu_region_context_wait(dev, seen, LEARN_POLL_NS); /* woken at its publication */
    }
    return estimate(dev);
}

void vgpu_ctxmem_cancel(struct vgpu_ctxmem_probe *p) {
    if (p->claimed) vgpu_region_context_publish(p->dev, 0, VGPU_CONTEXT_UNKNOWN, 0, 1);
    p->claimed = 0;
}

uint64_t vgpu_ctxmem_after(struct vgpu_ctxmem_probe *p) {
    int dev = p->dev;
    char a[32], b[32];
    if (p->learned) {
        vgpu_format_bytes(p->charge, b, sizeof b);
        vgpu_log(VGPU_LOG_DEBUG, "context on device %d: charged %s, the size the slice learned (NVML not asked)", dev, b);
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
    if (p->learned || p->pub_source == VGPU_CONTEXT_UNKNOWN) {
        vgpu_ctxmem_cancel(p); /* nothing measured: the claim (if any) goes to the next process */
        return;
    }
    vgpu_region_context_publish(p->dev, p->pub_bytes, p->pub_source, p->cuda_total, p->claimed);
    p->claimed = 0;
    p->pub_source = VGPU_CONTEXT_UNKNOWN;
}

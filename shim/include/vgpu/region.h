/*
 * The slice accounting file: one memory-mapped file shared by every process of a slice
 * (CUDA_DEVICE_MEMORY_SHARED_CACHE). All processes that map the same file share one memory
 * quota per device.
 *
 * This header is the single definition of the layout. The C shim includes it, and the
 * Python reader (sharing/_region_build.py) feeds the part between the CFFI markers to cffi
 * (after the CFFI part of compute_state.h), so that part must stay plain C declarations
 * (no #include, no macros with arguments, integer #defines only).
 * Any layout change bumps VGPU_REGION_LAYOUT_VERSION.
 *
 * Protocol (shim/src/region.c implements it; sharing/region.py reads it):
 *  - The file is created complete: built in a temporary file in the same directory, then
 *    link()ed into place. Nobody ever sees a half-initialised file; nobody waits to create it.
 *  - The first 32-bit word of `lock` is the lock (creators may initialise a pthread mutex
 *    there: all that matters is that the word starts at 0). It guards every write to
 *    devices[].used and procs[].used[]/state; the critical sections make no system calls.
 *    0 = free, else the holder's token: slot index + 1 in the low 11 bits (VGPU_MAX_PROCS + 1:
 *    no slot yet), a sequence number above. Taken and released by compare-and-swap. A waiter
 *    takes it over (compare-and-swap of the token it saw) when the token's slot byte is not
 *    locked (holder dead), when the word is not a token, or after 2 s; it then recomputes
 *    devices[d].used as the sum of procs[].used[d] over VGPU_SLOT_LIVE slots.
 *  - Slot i is owned by whoever holds an fcntl open-file-description write lock on the one
 *    byte at file offset VGPU_SLOT_LOCK_BASE + i (held for the owner's lifetime; the kernel
 *    drops it when the process dies, in any PID namespace). A slot in state VGPU_SLOT_LIVE
 *    whose byte lock can be taken belongs to a dead process: its charges are reclaimed.
 *  - Slots are claimed lowest-free-first, so slots_hwm stays near the number of processes and a
 *    dead-slot scan looks at few slots.
 *  - Invariant (under the lock): devices[d].used == sum over LIVE slots of procs[i].used[d].
 *  - Readers that do not take the lock (the exporter, `vgpu top`) read devices[] words as they
 *    are: every write to devices[].used/peak/denials/denied_bytes is a single __atomic store of
 *    a naturally aligned 64-bit word, so a reader never sees a torn value (it may see `used`
 *    and `peak` of slightly different instants). Readers never take the lock.
 *  - A context's size (devices[d].context_bytes/context_source): a process that finds
 *    none learned claims the measurement by compare-and-swap of context_measurer from 0 to its
 *    slot + 1, measures, publishes under the lock (an exact measurement replaces one from the
 *    device's used memory; between two of one kind the smaller stays), sets context_measurer
 *    back to 0 and wakes its FUTEX_WAIT-ers. Others wait on that word (while the measurer lives) for the value; a
 *    claim whose slot's byte lock nobody holds (a dead measurer) or that is not a slot is taken
 *    over. context_bytes is a single atomic 64-bit store, read without the lock.
 */
#ifndef VGPU_REGION_H
#define VGPU_REGION_H

#include <stdint.h>

#include "vgpu/compute_state.h"

/* CFFI-BEGIN */
#define VGPU_REGION_MAGIC          0x55504756 /* "VGPU" little-endian */
#define VGPU_REGION_LAYOUT_VERSION 6
/* Devices of a process that are accounted: 64 covers the largest nodes (16 GPUs; 8 GPUs split into
 * 7 MIG instances each = 56). A device past it is refused memory when a limit is set (devices.c). */
#define VGPU_MAX_DEVICES    64
#define VGPU_MAX_PROCS      1024
#define VGPU_LOCK_WORDS     8 /* 64 bytes: the lock word (first 32 bits) and room (it once held a pthread mutex) */
#define VGPU_SLOT_LOCK_BASE 0 /* slot i's liveness lock is on file byte VGPU_SLOT_LOCK_BASE + i */
#define VGPU_SLOT_FREE      0
#define VGPU_SLOT_LIVE      1
/* devices[].context_source */
#define VGPU_CONTEXT_UNKNOWN 0 /* nothing learned */
#define VGPU_CONTEXT_DEVICE  1 /* from the device's used memory before/after (may include others') */
#define VGPU_CONTEXT_EXACT   2 /* from the measuring process's own NVML entry */
#define VGPU_CONTEXT_FAILED  3 /* a process tried and NVML said nothing: others measure themselves */
/* procs[].limits_source: where the limits the slot's process enforces come from */
#define VGPU_LIMITS_UNKNOWN 0 /* not published */
#define VGPU_LIMITS_ENV     1 /* the environment (`vgpu run`, a plain LD_PRELOAD) */
#define VGPU_LIMITS_FILE    2 /* the plugin's read-only limits file: limits_dev/ino/hash say which */

struct vgpu_region_header {
    uint32_t magic;          /* VGPU_REGION_MAGIC */
    uint32_t layout_version; /* VGPU_REGION_LAYOUT_VERSION */
    uint64_t file_size;      /* sizeof(struct vgpu_region): the exact size of the file */
    uint32_t max_devices;    /* VGPU_MAX_DEVICES */
    uint32_t max_procs;      /* VGPU_MAX_PROCS */
    uint64_t created_unix_ns;
};

/* Usage only: a slice's limits are never read from this file (any process of the slice can write
 * it); they come from the plugin's read-only limits file or the environment (docs/shim.md). */
struct vgpu_device_account {
    uint64_t used;    /* bytes charged by all live slots */
    uint64_t peak;    /* highest `used` seen (diagnostics) */
    uint64_t denials; /* allocations refused over quota */
    /* Counters for observers (exporter, `vgpu top`). */
    uint64_t denied_bytes; /* bytes asked for by the refused allocations */
    /* A context's own device memory on this device, learned by the slice's first process that
     * measured it (shim/src/ctxmem.c): later processes charge it without asking NVML.
     * Written by the tenant's processes like `used`: the shim bounds it by VGPU_CONTEXT_RESERVE
     * from below and ignores it at or above the device's memory (docs/shim.md, threat model). */
    uint64_t context_bytes;    /* 0: not learned yet */
    uint32_t context_source;   /* VGPU_CONTEXT_* : how context_bytes was measured */
    uint32_t context_measurer; /* slot + 1 of the process measuring it now, 0 none (a futex word) */
};

struct vgpu_proc_slot {
    int32_t pid;         /* in the owner's PID namespace: informational, never a liveness test */
    uint32_t state;      /* VGPU_SLOT_FREE or VGPU_SLOT_LIVE */
    uint64_t generation; /* bumped at every claim of this slot */
    /* What the process enforces, written at the claim: the watchdog compares it with
     * the claim's limits file (a process enforcing other limits is a violation). Like `used`,
     * the tenant can write it: it catches a genuine shim misled, not a tampered one (the watchdog
     * checks the mapped shim's identity for that). */
    uint32_t limits_source; /* VGPU_LIMITS_* */
    uint32_t limits_reserved;
    uint64_t limits_dev; /* the limits file's st_dev, st_ino as the process opened it */
    uint64_t limits_ino;
    uint64_t limits_hash;            /* FNV-1a 64 of the file's bytes as the process read them */
    uint64_t used[VGPU_MAX_DEVICES]; /* bytes this process has charged, per device index */
};

struct vgpu_region {
    struct vgpu_region_header header;
    uint64_t lock[VGPU_LOCK_WORDS]; /* the lock word (first 32 bits), see the protocol above */
    uint64_t lock_recoveries;       /* take-overs: a dead, hung or garbage holder (totals recomputed) */
    uint64_t reclaimed_slots;       /* dead processes whose charges were returned */
    uint32_t slots_hwm;             /* slots [0, slots_hwm) have ever been claimed: scans stop there */
    uint32_t reserved0;
    struct vgpu_device_account devices[VGPU_MAX_DEVICES];
    struct vgpu_compute_state compute[VGPU_MAX_DEVICES];
    struct vgpu_proc_slot procs[VGPU_MAX_PROCS];
};
/* ---- The burst pool file (docs/policy.md, "Memory that bursts and is given back") ----
 * One node-wide file, the plugin's: written only by the plugin, in place (never replaced, so a
 * read-only bind mount of it sees every change), mounted read-only into bursting claims'
 * containers. Its own layout version: the accounting file's layout is unchanged by it.
 *  - devices[d]: the plugin's view of host device d (observers: pool and the sum of grants).
 *  - grants[k]: one per bursting (claim, device). Each entry is written under its `seq`: the
 *    writer makes it odd, stores the fields (each a single aligned 64/32-bit store), makes it even
 *    again (the next even number); a reader reads seq, the fields, seq again and retries while
 *    they differ or seq is odd (shim/src/pool_io.c, the one implementation of both sides).
 *  - A slice's limits file names its entry (VGPU_BURST_GRANT_<i>) and the entry's key
 *    (VGPU_BURST_KEY_<i>): an entry with another key counts as grant 0 (given to another claim).
 *  - `grant` is what the slice may use above its request now. While the plugin takes memory back
 *    the entry says VGPU_GRANT_RECLAIM, `grant` already holds the lower value and `deadline_unix_ns`
 *    when the plugin stops the borrowers (0 under reclaim `wait`). */
#define VGPU_POOL_MAGIC          0x4c4f4f50 /* "POOL" little-endian */
#define VGPU_POOL_LAYOUT_VERSION 1
#define VGPU_POOL_MAX_GRANTS     1024
#define VGPU_GRANT_FREE          0
#define VGPU_GRANT_OPEN          1
#define VGPU_GRANT_RECLAIM       2

struct vgpu_pool_header {
    uint32_t magic;          /* VGPU_POOL_MAGIC */
    uint32_t layout_version; /* VGPU_POOL_LAYOUT_VERSION */
    uint64_t file_size;      /* sizeof(struct vgpu_pool) */
    uint32_t max_devices;    /* VGPU_MAX_DEVICES */
    uint32_t max_grants;     /* VGPU_POOL_MAX_GRANTS */
    uint64_t created_unix_ns;
};

struct vgpu_pool_device {
    uint64_t seq;       /* as a grant's */
    uint64_t capacity;  /* the device's memory */
    uint64_t reserved;  /* the policy's reservedMemory */
    uint64_t requested; /* the sum of the prepared claims' requests */
    uint64_t pool;      /* capacity - reserved - requested (0 when negative) */
    uint64_t granted;   /* the sum of the device's grants (<= pool) */
};

struct vgpu_pool_grant {
    uint64_t seq;              /* even: stable; odd: being written */
    uint64_t key;              /* the owner's key (its limits file's VGPU_BURST_KEY_<i>), 0: free */
    uint32_t device;           /* host device index */
    uint32_t state;            /* VGPU_GRANT_* */
    uint64_t request;          /* the owner's request on the device (observers) */
    uint64_t limit;            /* its limit (observers) */
    uint64_t grant;            /* bytes it may use above its request now */
    uint64_t deadline_unix_ns; /* VGPU_GRANT_RECLAIM under evict: when the borrowers are stopped */
};

struct vgpu_pool {
    struct vgpu_pool_header header;
    struct vgpu_pool_device devices[VGPU_MAX_DEVICES];
    struct vgpu_pool_grant grants[VGPU_POOL_MAX_GRANTS];
};
/* CFFI-END */

_Static_assert(VGPU_DEMAND_DEVICES == VGPU_MAX_DEVICES, "a demand file has an entry per accounted device");
_Static_assert(sizeof(struct vgpu_device_account) == 48, "devices[] entries are part of the layout");
_Static_assert(sizeof(struct vgpu_proc_slot) == 48 + 8 * VGPU_MAX_DEVICES, "procs[] entries are part of the layout");
_Static_assert(__builtin_offsetof(struct vgpu_device_account, context_measurer) % 4 == 0, "a futex word is 4-aligned");
_Static_assert(sizeof(struct vgpu_pool_device) == 48, "pool devices[] entries are part of the pool's layout");
_Static_assert(sizeof(struct vgpu_pool_grant) == 56, "grants[] entries are part of the pool's layout");
_Static_assert(sizeof(struct vgpu_pool_header) == 32, "the pool's header is part of its layout");

#endif

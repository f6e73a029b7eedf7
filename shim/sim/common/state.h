/*
 * Node-wide state in SIMGPU_STATE (state.c): memory pools, process slots, the scheduler's lanes,
 * device timelines and busy-time rings (memory-mapped, shared by every process of the node).
 */
#ifndef VGPU_SIM_STATE_H
#define VGPU_SIM_STATE_H

#include "config.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define SIM_MAX_PROCS  128
#define SIM_BUCKET_NS  10000000ull /* device busy ring: 10 ms buckets ... */
#define SIM_DEV_RING   4096        /* ... 41 s of history and scheduled future */
#define SIM_PBUCKET_NS 50000000ull /* per-process busy ring: 50 ms buckets ... */
#define SIM_PROC_RING  1024        /* ... 51 s */

typedef struct {
    uint64_t used;                       /* bytes charged by all processes (under the state lock) */
    _Atomic uint64_t ring[SIM_DEV_RING]; /* (bucket index << 24) | busy microseconds in it */
    _Atomic uint64_t launches;
} sim_dev_state;

/* A process slot: small and contiguous, so that scanning the slots touches few pages. Its busy
 * rings (sim_shared.proc_ring) are large and reset lazily per device (proc_ring_gen). */
typedef struct {
    int32_t pid;                    /* in the process's own PID namespace (sim_slot_host_pid) */
    uint32_t gen;                   /* bumped at every claim of the slot */
    uint64_t used[SIM_MAX_DEVICES]; /* bytes charged by this process */
    uint32_t contexts[SIM_MAX_DEVICES];
} sim_proc_slot;

/* The device scheduler (sched.c). Each process (slot) has one *lane* per device: its work in
 * submission order (every stream and context of the process on that device, FIFO). A position
 * in a lane is the cumulative device time queued into it; work is complete once the lane's
 * served time reaches its end position, whatever the wall-clock times were. */
#define SIM_SEGS                                                                                                       \
    64 /* service history kept per lane (event times; each process
                                        * also mirrors its own lanes' history: sched.c) */
typedef struct {
    uint64_t t0, s0, len; /* the lane ran from served s0 for len ns starting at t0 */
} sim_seg;

typedef struct {
    uint64_t t;         /* the state below is as of this CLOCK_MONOTONIC time */
    uint64_t slice_end; /* the owner's time slice expires then */
    int32_t owner;      /* lane on the device, -1: idle */
    uint32_t pad;
    uint64_t active[(SIM_MAX_PROCS + 63) / 64]; /* lanes with pending work */
    uint64_t pend[SIM_MAX_PROCS];               /* ns queued and not yet run, per lane */
} sim_run;

typedef struct {
    uint64_t submitted; /* cumulative ns queued (served = submitted - pend) */
    uint64_t seg_count; /* segments ever written; the last is seg[(count-1) % SIM_SEGS] */
    sim_seg seg[SIM_SEGS];
} sim_lane;

typedef struct {
    pthread_mutex_t lock; /* robust, process-shared: guards run and lanes */
    sim_run run;
    sim_lane lane[SIM_MAX_PROCS];
} sim_sched;

/* A physical VMM allocation that can be shared between processes (cuMemCreate with a POSIX file
 * descriptor handle type; cuda/vmm.c): its memory stays on the device while any process holds a
 * handle to it or maps it. Its bytes are in exactly one holder's slot (`carrier`, NVML's process
 * list shows them there), so the device's used stays the sum of the slots' (recompute_totals);
 * when the carrier lets go, or dies, they move to another holder, and leave the device with the
 * last one. Entries change only under the state lock. */
#define SIM_MAX_VMM_SHARES 1024
typedef struct {
    uint64_t key;    /* the memfd's inode number (unique while any holder keeps it open); 0: free */
    uint64_t bytes;  /* charged to (carrier, dev) */
    int32_t dev;     /* physical device */
    int32_t carrier; /* slot */
    uint64_t holders[(SIM_MAX_PROCS + 63) / 64]; /* bit i: slot i holds a handle or a mapping */
} sim_vmm_share;

typedef struct {
    uint64_t magic;
    uint64_t size;
    pthread_mutex_t lock;                       /* robust, process-shared: guards used/active/contexts */
    uint64_t active[(SIM_MAX_PROCS + 63) / 64]; /* bit i: slot i is claimed (under the lock) */
    sim_dev_state dev[SIM_MAX_DEVICES];
    sim_proc_slot proc[SIM_MAX_PROCS];
    sim_sched sched[SIM_MAX_DEVICES]; /* per physical device */
    sim_vmm_share vmm[SIM_MAX_VMM_SHARES];
    /* proc_ring[slot][dev] is the slot's owner's only when proc_ring_gen[slot][dev] equals the
     * slot's gen: the first record of a new owner on a device clears it (8 KiB, not all 1 MiB
     * of the slot's rings at every claim). */
    _Atomic uint32_t proc_ring_gen[SIM_MAX_PROCS][SIM_MAX_DEVICES];
    _Atomic uint64_t proc_ring[SIM_MAX_PROCS][SIM_MAX_DEVICES][SIM_PROC_RING];
} sim_shared;

extern sim_shared *sim_shm;

static inline int sim_slot_active(int i) { return (int)((sim_shm->active[i / 64] >> (i % 64)) & 1); }

/* The slot locks: an OFD write lock on byte SIM_SLOT_LOCK_BASE + slot of the state file (past its
 * end) is held by the slot's owner for its lifetime (state.c). */
#define SIM_SLOT_LOCK_BASE (1ll << 30)
#define SIM_STATE_MAGIC    0x53494d4750553031ull /* "SIMGPU01": sim_shared.magic once initialised */

/* The state file's name in its directory: the layout's version and size are in it, so a file of
 * another layout is never misread. */
void sim_state_file_name(char *buf, size_t cap);
int sim_state_open(void);  /* map the node state; 0 or -1 (one stderr line) */
int sim_state_fd(void);    /* a descriptor of this process's state file, or -1 before sim_state_open */
void sim_state_lock(void); /* recovers from a dead owner (EOWNERDEAD) */
void sim_state_unlock(void);
void sim_state_reap_locked(int own_slot); /* return the memory of dead processes to the pools */
int sim_state_claim_slot(void);           /* this process's slot (held by an OFD lock), or -1 */
void sim_state_after_fork_child(void);    /* the child must not keep the parent's slot alive */
/* Charge `bytes` to (slot, dev) if the device has room: 0, or -1 when it would exceed `total`. */
int sim_mem_charge(int slot, int dev, uint64_t bytes, uint64_t total);
void sim_mem_uncharge(int slot, int dev, uint64_t bytes);
uint64_t sim_mem_used(int dev, int own_slot); /* reaps first */
/* Shareable VMM allocations (sim_vmm_share). create: charge `bytes` to (slot, dev) as a new shared
 * allocation `key` held by slot: 0, -1 no room on the device, -2 no free entry (nothing charged).
 * hold: slot holds `key` too (an import): 0, or -1 when no process holds it any more (freed).
 * drop: slot holds it no more (its last handle and mapping of it are gone). */
int sim_vmm_share_create(int slot, int dev, uint64_t key, uint64_t bytes, uint64_t total);
int sim_vmm_share_hold(int slot, int dev, uint64_t key);
void sim_vmm_share_drop(int slot, int dev, uint64_t key);
void sim_ctx_count(int slot, int dev, int delta);
/* Robust process-shared mutex set-up (state.c initialises every lock of the node state with it). */
void sim_robust_mutex_init(pthread_mutex_t *m);
/* Lock one of the node state's robust mutexes: 1 held, 2 held from an owner that died (repair,
 * then pthread_mutex_consistent), 0 not held. A lock word that is not one of our locks (the file
 * was overwritten) is initialised again; a holder that does not release the lock within
 * SIMGPU_LOCK_TIMEOUT_MS (stopped) is not waited for again: *wedged (the caller's, per lock)
 * remembers it, and later lockers only try until the lock is free again. `what` names the lock. */
int sim_robust_lock(pthread_mutex_t *m, _Atomic int *wedged, const char *what);
/* Is the slot's owner alive (its OFD lock held)? Caller holds the lock; own slot counts alive. */
int sim_slot_alive(int slot, int own_slot);
/* The slot's owner's PID as the caller's PID namespace sees it (the host's PID for a caller on the
 * host, as the kernel driver reports): own_slot is the caller's own (its recorded PID). */
int sim_slot_host_pid(int slot, int own_slot);

#endif

/*
 * Shared by the simulated libcuda.so.1 and libnvidia-ml.so.1 (each links its own copy: every
 * symbol here is hidden, so the two libraries never see each other's globals).
 *
 *   util.c    clocks, sleeping, environment knobs, quantity parsing, one-line diagnostics
 *   json.c    a small strict JSON parser (the SIMGPU_CONFIG file)
 *   config.c  SIMGPU_CONFIG -> sim_config (devices, driver and CUDA versions), with defaults
 *   state.c   node-wide state in SIMGPU_STATE: memory pools, process slots, device timelines,
 *             busy-time rings for utilisation (memory-mapped, shared by every process)
 *   sched.c   the device scheduler: processes time-slice each device (SIMGPU_TIMESLICE_US)
 */
#ifndef VGPU_SIM_COMMON_H
#define VGPU_SIM_COMMON_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <pthread.h>

/* ---------------------------------------------------------------- util.c */

uint64_t sim_now_ns(void);           /* CLOCK_MONOTONIC: one clock for all processes of the node */
uint64_t sim_realtime_us(void);      /* CLOCK_REALTIME in microseconds (NVML sample timestamps) */
void sim_sleep_until_ns(uint64_t t); /* absolute CLOCK_MONOTONIC deadline; never spins */
/* An unsigned integer environment knob; `dflt` when unset. Malformed values print one line and
 * use the default (a knob must not make a program fail). */
uint64_t sim_env_u64(const char *name, uint64_t dflt);
/* Parse a quantity: plain bytes ("1048576"), binary suffixes Ki Mi Gi Ti, decimal K M G T;
 * a decimal fraction is allowed with a suffix ("1.5Gi"). Returns 0 on success. */
int sim_parse_quantity(const char *s, uint64_t *out);
void sim_log(const char *fmt, ...) __attribute__((format(printf, 1, 2))); /* "simgpu: ...\n" */
void sim_copy_str(char *dst, size_t cap, const char *src);                /* truncating, NUL-terminated */

/* ---------------------------------------------------------------- json.c */

typedef enum {
    SIM_JSON_NULL,
    SIM_JSON_BOOL,
    SIM_JSON_NUMBER,
    SIM_JSON_STRING,
    SIM_JSON_ARRAY,
    SIM_JSON_OBJECT
} sim_json_type;

typedef struct sim_json {
    sim_json_type type;
    int boolean;
    double number;
    int is_integer; /* number written without fraction/exponent, fits uint64 or int64 */
    int negative;
    uint64_t integer;       /* magnitude when is_integer */
    char *string;           /* STRING: decoded UTF-8; also the key of an object member */
    char *key;              /* member name when the parent is an object */
    struct sim_json *child; /* first element / member */
    struct sim_json *next;  /* next sibling */
    size_t count;           /* elements / members */
} sim_json;

/* Parse `text` (len bytes). On error returns NULL and writes "line L column C: <what>" to err. */
sim_json *sim_json_parse(const char *text, size_t len, char *err, size_t errcap);
void sim_json_free(sim_json *j);
const sim_json *sim_json_get(const sim_json *obj, const char *key);
const char *sim_json_type_name(sim_json_type t);

/* ---------------------------------------------------------------- config.c */

#define SIM_MAX_DEVICES 128 /* a node of the simulator: more than any real one, past the shim's 64 */
#define SIM_NAME_LEN    96
#define SIM_UUID_LEN    64

typedef struct {
    char name[SIM_NAME_LEN];
    char uuid[SIM_UUID_LEN]; /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    unsigned char uuid_bytes[16];
    uint64_t memory; /* bytes */
    int sm_count;
    unsigned pci_domain, pci_bus, pci_device;
    int numa_node; /* -1: none */
    int cc_major, cc_minor;
    int healthy;
    unsigned long long xid; /* delivered while unhealthy */
    unsigned minor;
} sim_device_cfg;

typedef struct {
    int ndev;
    sim_device_cfg dev[SIM_MAX_DEVICES];
    char driver_version[80];
    int cuda_version;          /* 12080 = 12.8 */
    char path[512];            /* the file read, "" for the built-in default */
    int phys[SIM_MAX_DEVICES]; /* libcuda: CUDA ordinal -> node device index (CUDA_DEVICE_ORDER,
                                   * CUDA_VISIBLE_DEVICES) */
} sim_config;

/* Devices are in PCI bus order (as NVML enumerates them), whatever order the file lists them in.
 * Read SIMGPU_CONFIG (or build the default H100). On a malformed file prints one stderr line
 * naming the file, the field and what is allowed, and returns -1. */
int sim_config_load(sim_config *out);
/* Re-read only health ("healthy", "xid") of the devices of an already loaded config, if the file
 * changed since `*mtime_ns` (NVML event waits use it to see health flip while they wait). */
void sim_config_refresh_health(sim_config *cfg, int64_t *mtime_ns);
int64_t sim_config_mtime_ns(const char *path);
/* Order of two devices by PCI bus id (domain, bus, device): <0, 0, >0. */
int sim_pci_cmp(const sim_device_cfg *a, const sim_device_cfg *b);

/* ---------------------------------------------------------------- state.c */

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

typedef struct {
    uint64_t magic;
    uint64_t size;
    pthread_mutex_t lock;                       /* robust, process-shared: guards used/active/contexts */
    uint64_t active[(SIM_MAX_PROCS + 63) / 64]; /* bit i: slot i is claimed (under the lock) */
    sim_dev_state dev[SIM_MAX_DEVICES];
    sim_proc_slot proc[SIM_MAX_PROCS];
    sim_sched sched[SIM_MAX_DEVICES]; /* per physical device */
    /* proc_ring[slot][dev] is the slot's owner's only when proc_ring_gen[slot][dev] equals the
     * slot's gen: the first record of a new owner on a device clears it (8 KiB, not all 1 MiB
     * of the slot's rings at every claim). */
    _Atomic uint32_t proc_ring_gen[SIM_MAX_PROCS][SIM_MAX_DEVICES];
    _Atomic uint64_t proc_ring[SIM_MAX_PROCS][SIM_MAX_DEVICES][SIM_PROC_RING];
} sim_shared;

extern sim_shared *sim_shm;

static inline int sim_slot_active(int i) { return (int)((sim_shm->active[i / 64] >> (i % 64)) & 1); }

int sim_state_open(void);  /* map the node state; 0 or -1 (one stderr line) */
void sim_state_lock(void); /* recovers from a dead owner (EOWNERDEAD) */
void sim_state_unlock(void);
void sim_state_reap_locked(int own_slot); /* return the memory of dead processes to the pools */
int sim_state_claim_slot(void);           /* this process's slot (held by an OFD lock), or -1 */
void sim_state_after_fork_child(void);    /* the child must not keep the parent's slot alive */
/* Charge `bytes` to (slot, dev) if the device has room: 0, or -1 when it would exceed `total`. */
int sim_mem_charge(int slot, int dev, uint64_t bytes, uint64_t total);
void sim_mem_uncharge(int slot, int dev, uint64_t bytes);
uint64_t sim_mem_used(int dev, int own_slot); /* reaps first */
void sim_ctx_count(int slot, int dev, int delta);
/* Robust process-shared mutex set-up (state.c initialises every lock of the node state with it). */
void sim_robust_mutex_init(pthread_mutex_t *m);
/* Busy-time accounting of the interval [start, end) (ns) on the device and for the slot. */
void sim_busy_record(int dev, int slot, uint64_t start, uint64_t end);
/* Busy ns in complete buckets of [from, to). slot -1: the whole device. */
uint64_t sim_busy_between(int dev, int slot, uint64_t from, uint64_t to, uint64_t *window_ns);
/* Is the slot's owner alive (its OFD lock held)? Caller holds the lock; own slot counts alive. */
int sim_slot_alive(int slot, int own_slot);
/* The slot's owner's PID as the caller's PID namespace sees it (the host's PID for a caller on the
 * host, as the kernel driver reports): own_slot is the caller's own (its recorded PID). */
int sim_slot_host_pid(int slot, int own_slot);

/* ---------------------------------------------------------------- sched.c */

uint64_t sim_sched_slice_ns(void); /* SIMGPU_TIMESLICE_US */
/* Queue dur_ns on the slot's lane of device `dev`; returns the lane position at which it is done
 * and stores the lane's served position (as of now) in *served. */
uint64_t sim_sched_submit(int dev, int slot, uint64_t dur_ns, uint64_t *served);
uint64_t sim_sched_served(int dev, int slot); /* advances the device to now first */
/* 0 when position `pos` of the lane is done; else the earliest time it can be done given the
 * work queued now (later work of other processes can only move it later: re-check). */
uint64_t sim_sched_eta(int dev, int slot, uint64_t pos);
void sim_sched_wait(int dev, int slot, uint64_t pos); /* sleeps (re-checking) until pos is done */
/* When a done position completed, from the lane's service history; 0 if no longer known. */
uint64_t sim_sched_done_time(int dev, int slot, uint64_t pos);
void sim_sched_advance(int dev); /* bring the device's busy rings up to now */

#endif

/*
 * Per-device compute (SM cap) state of a slice, embedded in the accounting file (region.h) as
 * `struct vgpu_compute_state compute[VGPU_MAX_DEVICES]`, and the per-slice demand file through
 * which slices that share one physical device find each other (elastic policy).
 *
 * Owned by the compute-cap code (shim/src/compute*.c, docs/compute.md). Plain C between the
 * CFFI markers so the Python reader can see it: no #include, no macros with arguments.
 *
 * Every field that processes update concurrently is a naturally aligned 32/64-bit word accessed
 * only through __atomic builtins. There is no lock in shared memory: a process killed by SIGKILL
 * in the middle of an update leaves at most one reservation of budget behind (bounded by the
 * cost of one launch divided by the cap), never a held lock.
 *
 * Size: struct vgpu_compute_state is exactly 512 bytes (the size of the placeholder it replaced),
 * so the region layout did not change; a static assert in compute.c keeps it that way. A change
 * of its size or of the meaning of a field bumps VGPU_REGION_LAYOUT_VERSION in region.h.
 */
#ifndef VGPU_COMPUTE_STATE_H
#define VGPU_COMPUTE_STATE_H

#include <stdint.h>

/* CFFI-BEGIN */
#define VGPU_COMPUTE_STATE_VERSION  2
#define VGPU_COMPUTE_POLICY_OFF     0
#define VGPU_COMPUTE_POLICY_HARD    1
#define VGPU_COMPUTE_POLICY_ELASTIC 2

/* Usage and controller state only: the cap, policy and priority are each process's configuration
 * (the plugin's limits file or the environment), never read from here, since any process of the
 * slice can write this file. */
struct vgpu_compute_state {
    uint32_t version; /* VGPU_COMPUTE_STATE_VERSION once a capped process initialised it */
    uint32_t reserved_a;
    uint64_t slice_id;           /* random nonzero id, set once by CAS: the slice's name in demand files */
    int64_t tat_ns;              /* virtual-time bucket: theoretical arrival time, CLOCK_MONOTONIC ns */
    int64_t charged_ns;          /* device time charged: estimates at admission + corrections */
    uint64_t measured_ns;        /* device time of launches measured by events (raw elapsed) */
    uint64_t measured_launches;  /* launches whose events were read */
    uint64_t launches;           /* capped launches admitted (all processes) */
    uint64_t throttled;          /* launches that had to sleep */
    uint64_t wait_ns;            /* total time threads slept for budget */
    uint64_t last_launch_ns;     /* CLOCK_MONOTONIC of the newest launch (heartbeat) */
    uint32_t effective_permille; /* cap currently applied (elastic may lift it; 1000 = uncapped) */
    uint32_t attached;           /* processes that attached to this device's cap (monotonic count) */
    /* NVML outer loop (compute_nvml.c): a slow correction of the cost estimates from the driver's
     * per-process utilisation, run by one process of the slice per period (CAS on nvml_next_ns). */
    uint32_t nvml_factor_ppm;     /* multiplier of estimated costs, 1000000 = 1.0 (0 = unset = 1.0) */
    uint32_t nvml_usage_permille; /* the slice's share on this device at the last NVML reading */
    int64_t nvml_next_ns;         /* CLOCK_MONOTONIC of the next NVML reading */
    uint64_t nvml_launches_snap;  /* `launches` and `throttled` at the previous reading */
    uint64_t nvml_throttled_snap;
    int64_t nvml_charged_snap; /* `charged_ns` at the previous reading (0: none yet) */
    uint64_t reserved[48];     /* zero; room to grow without a layout change */
};

/* Elastic demand: one file per slice (per claim under the DRA driver). Each slice writes only its
 * own file; every slice reads the others' files of its node-state directory (read-only) to find
 * the idle share it may borrow. Under the DRA driver the plugin creates <dir>/<claim-uid>.demand
 * (exact size, header filled, the rest zero), mounts the directory read-only into every claim and
 * the claim's own file writable at VGPU_DEMAND_FILE; `vgpu run` slices create
 * <dir>/<slice-id>.demand themselves in a directory of their own user.
 * Entry d describes the slice's application device d; `uuid` names the physical device, so that
 * readers match entries of different slices by device. A reader trusts nothing in another slice's
 * file: values are clamped, and a lie can only cost its writer (docs/compute.md). */
#define VGPU_DEMAND_MAGIC       0x44475056 /* "VPGD" */
#define VGPU_DEMAND_VERSION     2          /* 2: 64 devices */
#define VGPU_DEMAND_DEVICES     64         /* = VGPU_MAX_DEVICES (vgpu/region.h checks it) */
#define VGPU_NODE_SLOT_STALE_NS 10000000000

struct vgpu_node_slot {
    uint64_t slice_id;       /* the slice's id (0 = entry unused) */
    int64_t want_until_ns;   /* the slice wants device time until then (CLOCK_MONOTONIC) */
    uint32_t cap_permille;   /* its guaranteed share (1000 when not capped) */
    uint32_t policy;         /* VGPU_COMPUTE_POLICY_* */
    int32_t priority;        /* lower = higher priority */
    uint32_t usage_permille; /* its recent measured share (informational) */
};

struct vgpu_demand_entry {
    uint8_t uuid[16];        /* the physical device (cuDeviceGetUuid); all zero = unused */
    struct vgpu_node_slot d; /* the slice's demand on it */
};

struct vgpu_demand_file {
    uint32_t magic;   /* VGPU_DEMAND_MAGIC */
    uint32_t version; /* VGPU_DEMAND_VERSION */
    uint32_t ndev;    /* VGPU_DEMAND_DEVICES (the entries below) */
    uint32_t pad;
    struct vgpu_demand_entry dev[VGPU_DEMAND_DEVICES];
};
/* CFFI-END */

#endif

/*
 * The busy-time rings of the node state: each device's ring of 10 ms buckets (NVML's
 * utilisation) and each slot's ring of 50 ms buckets per device (NVML's per-process utilisation,
 * a process's own device time). The scheduler (sched.c) records work as the device runs it;
 * readers that want the device's state as of now ask the scheduler (sim_sched_busy_between).
 */
#include "busy.h"

#include "util.h"

/* Ring entries: (bucket index mod 2^32) << 32 | busy ns within the bucket.
 * The scheduler records work as the device runs it (never ahead of now); buckets more than 3/4
 * of the ring ahead of now are refused all the same, so history readers need is never lost. */
static void ring_add(_Atomic uint64_t *ring, uint64_t n, uint64_t bucket_ns, uint64_t start, uint64_t end) {
    uint64_t limit = sim_now_ns() / bucket_ns + n - n / 4;
    while (start < end) {
        uint64_t b = start / bucket_ns;
        if (b >= limit) break;
        uint64_t bend = (b + 1) * bucket_ns;
        uint64_t e = end < bend ? end : bend;
        uint64_t add = e - start;
        uint64_t tag = b & 0xffffffffull;
        _Atomic uint64_t *slot = &ring[b % n];
        uint64_t old = atomic_load_explicit(slot, memory_order_relaxed), nv;
        do {
            if ((old >> 32) != tag)
                nv = (tag << 32) | add;
            else {
                uint64_t cur = (old & 0xffffffffull) + add;
                nv = (tag << 32) | (cur > bucket_ns ? bucket_ns : cur);
            }
        } while (!atomic_compare_exchange_weak_explicit(slot, &old, nv, memory_order_relaxed, memory_order_relaxed));
        start = e;
    }
}

static uint64_t ring_sum(_Atomic uint64_t *ring, uint64_t n, uint64_t bucket_ns, uint64_t from, uint64_t to,
                         uint64_t *window) {
    uint64_t b0 = (from + bucket_ns - 1) / bucket_ns, b1 = to / bucket_ns;
    if (b1 <= b0) {
        *window = 0;
        return 0;
    }
    if (b1 - b0 > n - 1) b0 = b1 - (n - 1);
    uint64_t sum = 0;
    for (uint64_t b = b0; b < b1; b++) {
        uint64_t v = atomic_load_explicit(&ring[b % n], memory_order_relaxed);
        if ((v >> 32) == (b & 0xffffffffull)) sum += v & 0xffffffffull;
    }
    *window = (b1 - b0) * bucket_ns;
    return sum;
}

void sim_busy_record(int dev, int slot, uint64_t start, uint64_t end) {
    if (dev < 0 || dev >= SIM_MAX_DEVICES) return;
    ring_add(sim_shm->dev[dev].ring, SIM_DEV_RING, SIM_BUCKET_NS, start, end);
    if (slot < 0 || slot >= SIM_MAX_PROCS) return;
    /* Callers hold the device's scheduler lock: one writer per (slot, dev) at a time. */
    uint32_t gen = __atomic_load_n(&sim_shm->proc[slot].gen, __ATOMIC_ACQUIRE);
    if (atomic_load_explicit(&sim_shm->proc_ring_gen[slot][dev], memory_order_acquire) != gen) {
        for (int b = 0; b < SIM_PROC_RING; b++) /* a new owner's first record on this device */
            atomic_store_explicit(&sim_shm->proc_ring[slot][dev][b], 0, memory_order_relaxed);
        atomic_store_explicit(&sim_shm->proc_ring_gen[slot][dev], gen, memory_order_release);
    }
    ring_add(sim_shm->proc_ring[slot][dev], SIM_PROC_RING, SIM_PBUCKET_NS, start, end);
}

static _Atomic uint64_t no_history[SIM_PROC_RING]; /* a slot's owner that never ran on the device */

uint64_t sim_busy_between(int dev, int slot, uint64_t from, uint64_t to, uint64_t *window_ns) {
    if (slot < 0) return ring_sum(sim_shm->dev[dev].ring, SIM_DEV_RING, SIM_BUCKET_NS, from, to, window_ns);
    uint32_t gen = __atomic_load_n(&sim_shm->proc[slot].gen, __ATOMIC_ACQUIRE);
    int own = atomic_load_explicit(&sim_shm->proc_ring_gen[slot][dev], memory_order_acquire) == gen;
    return ring_sum(own ? sim_shm->proc_ring[slot][dev] : no_history, SIM_PROC_RING, SIM_PBUCKET_NS, from, to,
                    window_ns);
}

uint64_t sim_busy_sum_copy(const uint64_t *ring, uint64_t n, uint64_t bucket_ns, uint64_t from, uint64_t to,
                           uint64_t *window) {
    uint64_t b0 = (from + bucket_ns - 1) / bucket_ns, b1 = to / bucket_ns;
    if (b1 <= b0 || n < 2) {
        *window = 0;
        return 0;
    }
    if (b1 - b0 > n - 1) b0 = b1 - (n - 1);
    uint64_t sum = 0;
    for (uint64_t b = b0; b < b1; b++) {
        uint64_t v = ring[b % n], busy = v & 0xffffffffull;
        if ((v >> 32) == (b & 0xffffffffull)) sum += busy < bucket_ns ? busy : bucket_ns; /* garbage: clamped */
    }
    *window = (b1 - b0) * bucket_ns;
    return sum;
}

/*
 * Read-only views of other node states (observe.c): SIMGPU_OBSERVE names state directories (what
 * SIMGPU_STATE names) of processes this process does not share a state with: `DIR` (or `DIR/` and
 * a star), every subdirectory of DIR; or `DIR/<star>/NAME`, the directory NAME in every
 * subdirectory of DIR.
 * NVML adds what they hold to its own state's, as a kernel driver sees every context of the
 * machine.
 *
 * Whoever can write an observed state may put anything in it, at any time: it is never mapped
 * and never locked. Every query opens the files again (never through a link, regular files
 * only), checks their size, reads the parts it needs into private memory (pread) and checks what
 * it read; a file that is short, shrunk, or not a state reads as an empty one. PIDs are only the
 * ones the kernel names (the holders of the slots' locks), never a recorded number.
 */
#ifndef VGPU_SIM_OBSERVE_H
#define VGPU_SIM_OBSERVE_H

#include "state.h"

#include <stdint.h>

#define SIM_OBSERVE_MAX 1024 /* observed state directories per query (more are ignored) */

typedef struct {
    int slot;
    uint32_t gen;
    unsigned pid;  /* as the kernel names the slot's owner in this process's PID namespace; 0: none */
    uint64_t used; /* on the device asked about, at most its total */
    int contexts;  /* the slot has a context on the device */
} sim_obs_proc;

typedef struct {
    int fd; /* the state file, read-only */
    int nproc;
    sim_obs_proc proc[SIM_MAX_PROCS]; /* live slots with memory or a context on the device */
} sim_obs_state;

typedef struct {
    int n;
    sim_obs_state *st;
} sim_obs_set;

/* Read every observed state's live slots on device `dev` (a device of `total` bytes). Always
 * succeeds (an empty set when SIMGPU_OBSERVE is unset or unusable: one stderr line). */
void sim_observe_open(sim_obs_set *set, int dev, uint64_t total);
void sim_observe_close(sim_obs_set *set);
/* Memory the observed states hold on the device (each slot's at most `total`; saturating). */
uint64_t sim_observe_used(const sim_obs_set *set);
/* Busy ns of the state's device `dev` (slot -1) or of one of its slots within the complete
 * buckets of [from, to), as sim_busy_between, the device run up to `now` on a private copy
 * (sim_sched_project); *window_ns the span counted. 0 when unreadable. */
uint64_t sim_observe_busy(const sim_obs_state *st, int dev, const sim_obs_proc *p, uint64_t from, uint64_t to,
                          uint64_t now, uint64_t *window_ns);

#endif

/*
 * The device scheduler (sched.c): processes time-slice each device (SIMGPU_TIMESLICE_US).
 */
#ifndef VGPU_SIM_SCHED_H
#define VGPU_SIM_SCHED_H

#include "state.h"

#include <stdint.h>

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
/* Busy ns of [from, to) as sim_busy_between, the device run up to now first: the rings are
 * written as the device runs. */
uint64_t sim_sched_busy_between(int dev, int slot, uint64_t from, uint64_t to, uint64_t *window_ns);

/* Busy ns within [from, to) that running the device `r` (a private copy of a state's sim_run) from
 * its time to `now` gives `lane` (-1: any lane), recording nothing: what an observer that may not
 * take the lock adds to the busy rings, which the state's own processes advance lazily. The copy
 * may hold anything (it is sanitised; the run is bounded). */
uint64_t sim_sched_project(sim_run *r, uint64_t now, int lane, uint64_t from, uint64_t to);

#endif

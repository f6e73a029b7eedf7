/*
 * The common part of the simulated libcuda.so.1 and libnvidia-ml.so.1 in one include, for the C
 * test programs (tests/c) that look inside the node state. The simulator's own files include
 * the header of each file they use. Each library links its own copy of the common files: every
 * symbol is hidden, so the two libraries never see each other's globals.
 *
 *   util.c    clocks, sleeping, environment knobs, quantity parsing, one-line diagnostics
 *   json.c    a small strict JSON parser (the SIMGPU_CONFIG file)
 *   config.c  SIMGPU_CONFIG -> sim_config (devices, driver and CUDA versions), with defaults
 *   state.c   node-wide state in SIMGPU_STATE: memory pools, process slots (memory-mapped,
 *             shared by every process)
 *   busy.c    the busy-time rings of the node state (utilisation)
 *   sched.c   the device scheduler: processes time-slice each device (SIMGPU_TIMESLICE_US)
 *   observe.c read-only views of other node states (SIMGPU_OBSERVE), never mapped or locked
 */
#ifndef VGPU_SIM_COMMON_H
#define VGPU_SIM_COMMON_H

#include "busy.h"
#include "config.h"
#include "json.h"
#include "observe.h"
#include "sched.h"
#include "state.h"
#include "util.h"

#endif

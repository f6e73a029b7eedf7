/*
 * Streams, synchronisation and events: the process's lane of each device (stream.c).
 */
#ifndef VGPU_SIM_CUDA_STREAM_H
#define VGPU_SIM_CUDA_STREAM_H

#include "objects.h"

#include <stdint.h>

/* Resolve a stream handle (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or a created stream);
 * `ptds`: the per-thread-default-stream variant of the API is being called. */
CUresult sim_resolve_stream(CUstream h, int ptds, struct CUstream_st **out);
struct CUstream_st *sim_stream_new(struct CUctx_st *ctx, int kind, unsigned flags, int priority);
void sim_stream_release(struct CUstream_st *s);
/* Queue dur_ns of device time on the stream (the process's lane of the device); paces the caller. */
void sim_stream_enqueue(struct CUstream_st *s, uint64_t dur_ns);
uint64_t sim_stream_sync_target(struct CUstream_st *s); /* lane position when all work the stream waits for is done */
void sim_stream_drain(struct CUstream_st *s);           /* sleep until then (no capture check) */
void sim_lane_wait(struct CUctx_st *ctx, uint64_t pos); /* sleep until the context's lane reaches pos */
CUresult sim_stream_wait(struct CUstream_st *s);        /* host-blocking sync on a stream */
/* A host-blocking synchronisation of the context's work finished: the function registered with
 * sim_stream_on_sync runs with the context's device (pools release memory then, pools.c). */
void sim_after_sync(struct CUctx_st *ctx);
void sim_stream_on_sync(void (*fn)(int dev));
/* simulator-only ground truth of a process's device time (found by dlsym) */
__attribute__((visibility("protected"))) CUresult simgpuProcessBusyNs(CUdevice dev, unsigned long long from_ns,
                                                                      unsigned long long to_ns,
                                                                      unsigned long long *busy_ns,
                                                                      unsigned long long *window_ns);
void sim_stream_fork_prepare(void);
void sim_stream_fork_parent(void);
void sim_stream_fork_child(void);

#endif

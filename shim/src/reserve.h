/*
 * Charging device memory (reserve.c): what an allocation takes as the driver reports it, reserved
 * in the accounting file before it is taken. Modules that hold charges they can give back (pools,
 * graph memory) and the runtime's primary contexts plug in here (registered callbacks), so this
 * file depends on none of them.
 */
#ifndef VGPU_RESERVE_H
#define VGPU_RESERVE_H

#include <stdint.h>

#include "vgpu/cuda_api.h"

/* What the slice is shown as a device's total (its request; its burst limit if it opted in to see
 * it: VGPU_MEMORY_SHOW_LIMIT) and what it is shown it may use now (its request; with the opt-in,
 * its request plus its grant), 0 = unlimited. docs/policy.md, "What the slice sees". */
uint64_t vgpu_mem_shown_total(int dev);
uint64_t vgpu_mem_allowed_now(int dev);
/* Is memory accounting on (a region is in use and control not disabled)? */
int vgpu_mem_active(void);
/* Reserve bytes on dev, printing the once-per-process denial line on refusal. Before refusing,
 * every registered settle function gives back (trimmed) what it merely caches, and the charge is
 * retried. CUDA_SUCCESS or CUDA_ERROR_OUT_OF_MEMORY. */
CUresult vgpu_mem_reserve(int dev, uint64_t bytes);
void vgpu_mem_release(int dev, uint64_t bytes);
/* Charge bytes on dev against the slice's bound now (its request, plus its grant while it bursts:
 * burst.h), undone if the grant fell meanwhile. As vgpu_region_charge: 0, -1 refused, -2 unusable. */
int vgpu_mem_charge_bounded(int dev, uint64_t bytes, uint64_t *used_out);
/* A settle function: bring device index dev's charge of a cache to what it holds (trim it first
 * if trim); nonzero if some charge was returned. Registered once, when the cache first exists. */
typedef int (*vgpu_mem_settle_fn)(int dev, int trim);
void vgpu_mem_add_settle(vgpu_mem_settle_fn fn);
/* Run every settle function for dev; nonzero if some charge was returned. */
int vgpu_mem_settle(int dev, int trim);
/* Called before every charge on dev (context.c: a primary context retained out of the shim's
 * sight is charged first). One function. */
void vgpu_mem_before_charge(void (*fn)(int dev));
/* The device's page size as the driver reports it (cuMemGetAllocationGranularity), 0 if it
 * answered nothing. */
uint64_t vgpu_mem_page(int dev);
/* cuMemAllocPitch: the pitch the driver is expected to choose for width (its alignment as
 * learned so far), and what it answered for width (learn the alignment from it). */
uint64_t vgpu_mem_pitch_expected(int dev, uint64_t width);
void vgpu_mem_pitch_learn(int dev, uint64_t width, uint64_t pitch);
/* What an allocation of size bytes takes at most on device index dev, from what the driver
 * reports (a page-rounded size from half a page up, else its allocation alignment). */
uint64_t vgpu_mem_estimate(int dev, uint64_t size);
/* Reserve what the driver takes for an allocation of size on dev (*charged bytes, *unit its
 * share of the small-allocation pages, or 0), and give it back. */
CUresult vgpu_mem_take(int dev, uint64_t size, uint64_t *charged, uint64_t *unit);
void vgpu_mem_give_back(int dev, uint64_t bytes, uint64_t unit);
/* An allocation on a device past VGPU_MAX_DEVICES (index VGPU_DEVICE_UNACCOUNTED): refused with
 * CUDA_ERROR_OUT_OF_MEMORY while a memory limit is set (one log line per process), else
 * CUDA_SUCCESS (the driver's, unaccounted). */
CUresult vgpu_mem_unaccounted(void);

#endif

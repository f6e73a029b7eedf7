/* Device identity as the application sees it (devices.c): CUdevice and NVML handles to app-visible indices. */
#ifndef VGPU_DEVICES_H
#define VGPU_DEVICES_H

#include "vgpu/cuda_api.h"
#include "vgpu/nvml_api.h"

/* Build the CUdevice <-> app index map (once, after a successful real cuInit). */
void vgpu_devices_discover(void);
/* App-visible index; -1: not a device (the driver's error follows); VGPU_DEVICE_UNACCOUNTED: one
 * of the driver's devices past the first VGPU_MAX_DEVICES, which have no account (memory on it
 * is refused while a limit is set: vgpu_mem_unaccounted). They need cuInit to have succeeded. */
#define VGPU_DEVICE_UNACCOUNTED (-2)
int vgpu_device_index(CUdevice dev);
int vgpu_current_device_index(void);            /* of the current context's device, or -1 (no context) / -2 */
int vgpu_device_unaccounted_ordinal(void);      /* the ordinal of the last -2 answer (for a log line) */
int vgpu_device_handle(int idx, CUdevice *out); /* the CUdevice of index idx: 0, or -1 */
/* The driver shows this process exactly one device (so every context is on it): 1, else 0 (also
 * before discovery). */
int vgpu_device_only_one(void);
/* The app-visible index of an NVML device handle, or -1 (not visible, or unknown): by UUID
 * against the map when CUDA is initialised in the process; else from CUDA_VISIBLE_DEVICES (UUID
 * entries; numeric ones only when CUDA's order is known to be NVML's). Never initialises CUDA. */
int vgpu_nvml_device_index(nvmlDevice_t dev);

#endif

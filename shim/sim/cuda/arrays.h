/*
 * CUDA arrays, and the row pitch alignment they share with pitched memory (arrays.c).
 */
#ifndef VGPU_SIM_CUDA_ARRAYS_H
#define VGPU_SIM_CUDA_ARRAYS_H

#include <stdint.h>

#define SIM_PITCH_ALIGN (sim_pitch_alignment()) /* cuMemAllocPitch / array row pitch alignment */
uint64_t sim_pitch_alignment(void);             /* SIMGPU_PITCH_ALIGNMENT, checked */

#endif

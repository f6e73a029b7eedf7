/*
 * Virtual memory management (vmm.c): what the rest of the simulator calls of it.
 */
#ifndef VGPU_SIM_VMM_H
#define VGPU_SIM_VMM_H

void sim_vmm_after_fork(void); /* fork child: forget the parent's VMM handles and reservations */

#endif

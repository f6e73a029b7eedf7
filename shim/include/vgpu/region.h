/*
 * The slice accounting file: one memory-mapped file shared by every process of a slice.
 *
 * This header is the single definition of the layout. The C shim includes it, and the
 * Python reader (sharing/_region_build.py) feeds the part between the CFFI markers to cffi,
 * so that part must stay plain C declarations (no #include, no macros with arguments).
 * Any layout change bumps VGPU_REGION_LAYOUT_VERSION.
 */
#ifndef VGPU_REGION_H
#define VGPU_REGION_H

#include <stdint.h>

/* CFFI-BEGIN */
#define VGPU_REGION_MAGIC 0x55504756   /* "VGPU" little-endian */
#define VGPU_REGION_LAYOUT_VERSION 1

struct vgpu_region_header {
    uint32_t magic;
    uint32_t layout_version;
    uint64_t file_size;
};
/* CFFI-END */

#endif

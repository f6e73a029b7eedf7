/* The C library's dl* functions where glibc before 2.34 keeps them in libdl.so.2 (compat.c; the
 * renamed calls themselves are in glibc_compat.h, included into every file by the build). */
#ifndef VGPU_COMPAT_H
#define VGPU_COMPAT_H

/* name@version from libdl.so.2, loading it first if no object has it (a glibc older than 2.34
 * whose process did not load libdl at start). NULL if it cannot. */
void *vgpu_compat_dl_sym(const char *name, const char *version);
/* 1 if compat.c loaded libdl.so.2 itself (outside the start-up scope RTLD_NEXT searches). */
int vgpu_compat_libdl_loaded_here(void);

#endif

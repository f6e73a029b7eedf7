/* Files in shared directories (safefile.c): opened without following a link, checked before use. */
#ifndef VGPU_SAFEFILE_H
#define VGPU_SAFEFILE_H

#include <stddef.h>

/* Open the directory of `path` (links in the directory's path are followed) and put the last
 * component in base. The descriptor, or -1 with *why set. */
int vgpu_dir_open(const char *path, char *base, size_t baselen, char *why, size_t len);
/* A directory we may create or open files in: owned by us or root, and if others may write it,
 * sticky (*shared = 1 then). 0, or -1 with *why. */
int vgpu_dir_check(int dfd, int *shared, char *why, size_t len);
/* An opened file we may use: regular, and in a shared directory owned by us or root. */
int vgpu_file_check(int fd, int dir_shared, char *why, size_t len);
/* A one-line reason for an open() errno (ELOOP: a link, refused). */
const char *vgpu_open_error(int err);

#endif

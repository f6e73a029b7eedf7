/*
 * Opening files in directories that other users may write (the accounting file's directory, the
 * node-state directory) without being turned against the caller: a root process must never
 * follow a link another user planted there, nor use a file another user prepared.
 *
 * Rules (docs/shim.md, "Files"): the last component is never followed (O_NOFOLLOW); files are
 * opened relative to a directory descriptor whose owner and mode were checked; a directory is
 * trusted only if it belongs to the caller or root and, when others may write it, has the sticky
 * bit; in such a shared directory a file is used only if it belongs to the caller or root.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "safefile.h"
#include "shim_internal.h"

int vgpu_dir_check(int dfd, int *shared, char *why, size_t len) {
    struct stat st;
    if (vgpu_fstat(dfd, &st) != 0) {
        snprintf(why, len, "cannot stat its directory: %s", strerror(errno));
        return -1;
    }
    if (!S_ISDIR(st.st_mode)) {
        snprintf(why, len, "its directory is not a directory");
        return -1;
    }
    if (st.st_uid != geteuid() && st.st_uid != 0) {
        snprintf(why, len, "its directory belongs to uid %u, neither this user nor root", (unsigned)st.st_uid);
        return -1;
    }
    int writable = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
    if (writable && !(st.st_mode & S_ISVTX)) {
        snprintf(why, len, "its directory is writable by others without the sticky bit (mode %04o)",
                 (unsigned)(st.st_mode & 07777));
        return -1;
    }
    if (shared) *shared = writable;
    return 0;
}

int vgpu_dir_open(const char *path, char *base, size_t baselen, char *why, size_t len) {
    const char *slash = strrchr(path, '/');
    const char *name = slash ? slash + 1 : path;
    if (*name == '\0' || strcmp(name, ".") == 0 || strcmp(name, "..") == 0 || strlen(name) >= baselen) {
        snprintf(why, len, "not a file path");
        errno = EINVAL;
        return -1;
    }
    snprintf(base, baselen, "%s", name);
    char dir[4096];
    if (slash == NULL)
        snprintf(dir, sizeof dir, ".");
    else if (slash == path)
        snprintf(dir, sizeof dir, "/");
    else if ((size_t)(slash - path) < sizeof dir)
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    else {
        snprintf(why, len, "path too long");
        errno = ENAMETOOLONG;
        return -1;
    }
    /* Links in the directory's own path are the admin's choice (/var/run -> /run): followed; the
     * directory they lead to is what is checked. */
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        int e = errno;
        if (e == ENOENT)
            snprintf(why, len, "its directory does not exist");
        else if (e == ENOTDIR)
            snprintf(why, len, "its directory is not a directory");
        else
            snprintf(why, len, "cannot open its directory: %s", strerror(e));
        errno = e;
        return -1;
    }
    return dfd;
}

int vgpu_file_check(int fd, int dir_shared, char *why, size_t len) {
    struct stat st;
    if (vgpu_fstat(fd, &st) != 0) {
        snprintf(why, len, "cannot stat: %s", strerror(errno));
        return -1;
    }
    if (S_ISDIR(st.st_mode)) {
        snprintf(why, len, "is a directory");
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(why, len, "is not a regular file");
        return -1;
    }
    if (dir_shared && st.st_uid != geteuid() && st.st_uid != 0) {
        snprintf(why, len, "belongs to uid %u in a directory others can write (refused: it could be planted)",
                 (unsigned)st.st_uid);
        return -1;
    }
    return 0;
}

const char *vgpu_open_error(int err) {
    switch (err) {
    case ELOOP: return "is a symbolic link (refused: it could point anywhere)";
    case EISDIR: return "is a directory";
    case EACCES: return "permission denied";
    default: return strerror(err);
    }
}

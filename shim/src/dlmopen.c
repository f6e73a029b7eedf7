/*
 * dlmopen: a second link-map namespace gets its own copy of every library it loads (the C
 * library, the driver), and nothing of this process's dynamic linking reaches in: the shim's
 * exports do not interpose there, so a driver loaded into a new namespace, directly or lazily by
 * a library loaded there (libcudart dlopens libcuda.so.1 at its first call), runs unhooked.
 *
 * So, while control is on:
 *   - dlmopen of the driver's own sonames (libcuda.so*, libnvidia-ml.so*, by name or by any
 *     path) into another namespace answers with the process's driver, the very instance the shim
 *     hooks (dlopen of the soname in the base namespace): dlsym on that handle gives the hooks;
 *   - dlmopen of anything else into another namespace is refused (NULL, dlerror() says why, one
 *     log line): the shim cannot see what that namespace will load later.
 * LM_ID_BASE is an ordinary dlopen: passed through untouched (a tail call, so $ORIGIN and the
 * caller's search path stay the application's). docs/shim.md (threat model) has the ruled-out
 * alternatives.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "init.h"
#include "log.h"
#include "symbols.h"
#include "shim_internal.h"

typedef void *(*dlmopen_fn)(Lmid_t, const char *, int);

static const char *const driver_sonames[] = {"libcuda.so", "libnvidia-ml.so"};

/* The soname of the process's driver library that `file` names, or NULL. */
static const char *driver_soname(const char *file) {
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    for (size_t i = 0; i < sizeof driver_sonames / sizeof driver_sonames[0]; i++) {
        size_t n = strlen(driver_sonames[i]);
        if (strncmp(base, driver_sonames[i], n) == 0 && (base[n] == '\0' || base[n] == '.'))
            return i == 0 ? "libcuda.so.1" : "libnvidia-ml.so.1";
    }
    return NULL;
}

/* Leave the reason in dlerror(): a failing dlopen of a path that cannot exist (nothing can be
 * created directly under /proc) whose name is the message. */
static void set_dlerror(const char *file) {
    char msg[256];
    snprintf(msg, sizeof msg, "/proc/vgpu-sharing: dlmopen of %.120s into a new namespace refused (GPU quota)", file);
    void *h = dlopen(msg, RTLD_LAZY | RTLD_NOLOAD);
    if (h != NULL) dlclose(h); /* cannot happen; never leak a reference */
}

__attribute__((noinline)) static void *vgpu_dlmopen(Lmid_t lmid, const char *file, int mode, int *pass) {
    *pass = 0;
    (void)vgpu_init(); /* a configuration error keeps control on: fail closed */
    const struct vgpu_config *cfg = vgpu_config();
    if (file == NULL || cfg->disabled) {
        *pass = 1;
        return NULL;
    }
    const char *soname = driver_soname(file);
    if (soname != NULL) {
        vgpu_log(VGPU_LOG_INFO, "dlmopen(%s) into namespace %ld: the process's %s instead", file, (long)lmid, soname);
        return dlopen(soname, mode);
    }
    vgpu_log(VGPU_LOG_ERROR,
             "dlmopen(%s) into a new link-map namespace refused: a GPU driver loaded there would escape "
             "the slice's quota",
             file);
    set_dlerror(file);
    return NULL;
}

__attribute__((optimize("optimize-sibling-calls"))) VGPU_EXPORT void *dlmopen(Lmid_t lmid, const char *file, int mode) {
    dlmopen_fn real = (dlmopen_fn)vgpu_libc_sym("dlmopen");
    if (real == NULL) return NULL;
    if (lmid == LM_ID_BASE) return real(lmid, file, mode);
    int pass;
    void *h = vgpu_dlmopen(lmid, file, mode, &pass);
    if (pass) return real(lmid, file, mode);
    return h;
}

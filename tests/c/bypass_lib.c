/*
 * A hostile library (tests/shim/test_bypass.py): loaded after the shim, it fetches the driver's
 * entry points by every dlsym route it can think of and calls them, hoping to reach the driver
 * without the shim. Linked against libcuda.so.1 and libnvidia-ml.so.1 (as a CUDA library is), so
 * its own handle's scope holds the driver.
 *
 *   bypass_resolve(route, name) -> the function `name` as the route answers it, or NULL
 *   routes: next (RTLD_NEXT) | default (RTLD_DEFAULT) | global (dlopen(NULL)) | self (this
 *   library's own handle: its dependencies) | cuda:FLAGS / nvml:FLAGS (dlopen of the driver's
 *   soname with FLAGS, '+'-separated: lazy now global local nodelete noload deepbind) |
 *   dlmopen_base (dlmopen(LM_ID_BASE, soname)) | dlmopen_new (dlmopen(LM_ID_NEWLM, soname)) |
 *   dlmopen_dep:PATH (dlmopen(LM_ID_NEWLM, PATH), PATH a library that needs the driver) |
 *   vsym:VERSION (dlvsym(driver's handle, name, VERSION)) | vnext:VERSION / vdefault:VERSION
 *   (dlvsym(RTLD_NEXT / RTLD_DEFAULT, name, VERSION))
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

static int flags_of(const char *s) {
    int f = 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *t = strtok_r(buf, "+", &save); t; t = strtok_r(NULL, "+", &save)) {
        if (!strcmp(t, "lazy"))
            f |= RTLD_LAZY;
        else if (!strcmp(t, "now"))
            f |= RTLD_NOW;
        else if (!strcmp(t, "global"))
            f |= RTLD_GLOBAL;
        else if (!strcmp(t, "local"))
            f |= RTLD_LOCAL;
        else if (!strcmp(t, "nodelete"))
            f |= RTLD_NODELETE;
        else if (!strcmp(t, "noload"))
            f |= RTLD_NOLOAD;
        else if (!strcmp(t, "deepbind"))
            f |= RTLD_DEEPBIND;
    }
    if ((f & (RTLD_LAZY | RTLD_NOW)) == 0) f |= RTLD_NOW;
    return f;
}

static const char *soname_of(const char *name) {
    return strncmp(name, "nvml", 4) == 0 ? "libnvidia-ml.so.1" : "libcuda.so.1";
}

static void report(const char *what, void *h) {
    if (h == NULL) printf("route=%s handle=NULL dlerror=\"%s\"\n", what, dlerror());
}

/* One handle per route and library, so that a route's functions come from one library instance
 * (each dlmopen(LM_ID_NEWLM) makes a new namespace). */
static struct {
    char route[256];
    const char *soname;
    void *handle;
} opened[32];

void *bypass_resolve(const char *route, const char *name) {
    void *h = NULL;
    if (!strcmp(route, "next")) return dlsym(RTLD_NEXT, name);
    if (!strcmp(route, "default")) return dlsym(RTLD_DEFAULT, name);
    if (!strncmp(route, "vnext:", 6)) return dlvsym(RTLD_NEXT, name, route + 6);
    if (!strncmp(route, "vdefault:", 9)) return dlvsym(RTLD_DEFAULT, name, route + 9);
    size_t i = 0;
    for (; i < sizeof opened / sizeof opened[0] && opened[i].handle; i++)
        if (!strcmp(opened[i].route, route) && opened[i].soname == soname_of(name))
            return dlsym(opened[i].handle, name);
    if (!strcmp(route, "global"))
        h = dlopen(NULL, RTLD_NOW);
    else if (!strcmp(route, "self"))
        h = dlopen("libvgpu_bypass_test.so", RTLD_NOW | RTLD_NOLOAD);
    else if (!strncmp(route, "cuda:", 5) || !strncmp(route, "nvml:", 5))
        h = dlopen(soname_of(name), flags_of(route + 5));
    else if (!strncmp(route, "vsym:", 5)) {
        h = dlopen(soname_of(name), RTLD_NOW);
        return h ? dlvsym(h, name, route + 5) : NULL;
    } else if (!strcmp(route, "dlmopen_base"))
        h = dlmopen(LM_ID_BASE, soname_of(name), RTLD_NOW);
    else if (!strcmp(route, "dlmopen_new"))
        h = dlmopen(LM_ID_NEWLM, soname_of(name), RTLD_NOW);
    else if (!strncmp(route, "dlmopen_dep:", 12))
        h = dlmopen(LM_ID_NEWLM, route + 12, RTLD_NOW);
    else {
        printf("route=%s unknown\n", route);
        return NULL;
    }
    report(route, h);
    if (h && i < sizeof opened / sizeof opened[0]) {
        snprintf(opened[i].route, sizeof opened[i].route, "%s", route);
        opened[i].soname = soname_of(name);
        opened[i].handle = h;
    }
    return h ? dlsym(h, name) : NULL;
}

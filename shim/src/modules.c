/*
 * Module globals (__device__ / __constant__ variables): device memory the driver allocates when
 * a module is loaded, charged to the slice.
 *
 * The shim cannot know before the load what the driver will allocate, so it asks afterwards:
 * the image names its variables (PTX: module-scope .global / .const declarations; an ELF cubin:
 * its symbol table's data objects; a fatbin: the uncompressed PTX and cubins inside it) and the
 * driver says where each lives and how big it is (cuModuleGetGlobal / cuLibraryGetGlobal: only
 * variables the driver actually allocated count, each once). Each is charged as the driver takes
 * an allocation of its size (vgpu_mem_take: pages, or a share of the small-allocation pages). A
 * load the quota cannot hold is undone (cuModuleUnload / cuLibraryUnload) and refused with
 * CUDA_ERROR_OUT_OF_MEMORY. The charge returns at cuModuleUnload / cuLibraryUnload, and when the
 * module's context is destroyed (cuCtxDestroy, or the primary context reset or released for the
 * last time: context.c tells us).
 * Not seen: compressed fatbin entries, images loaded through interfaces the shim does not hook
 * (the CUDA runtime's private loader).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "modules.h"
#include "devices.h"
#include "hooks.h"
#include "init.h"
#include "log.h"
#include "reserve.h"
#include "symbols.h"

struct global {
    CUdeviceptr ptr;
    uint64_t charged, unit;
};

struct mod_rec {
    void *handle;  /* CUmodule or CUlibrary */
    CUcontext ctx; /* a module's context (libraries: the one current at load) */
    int primary;   /* that context is its device's primary context */
    int dev;
    size_t n;
    struct global *g;
    struct mod_rec *next;
};

static pthread_mutex_t mods_mu = PTHREAD_MUTEX_INITIALIZER;
static struct mod_rec *mods;

typedef CUresult (*get_global_fn)(CUdeviceptr *, size_t *, void *, const char *);

/* ---- names in an image ---- */

typedef void (*name_cb)(const char *name, size_t len, void *arg);

static int is_ident(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '$';
}

/* PTX text: `[.visible|.weak] .global|.const [.align N] .type name[...] ...;` at module scope
 * (column 0; function bodies are indented). `.extern` declarations are defined elsewhere. */
static void ptx_names(const char *t, size_t len, name_cb cb, void *arg) {
    const char *end = t + len;
    for (const char *line = t; line < end;) {
        const char *nl = memchr(line, '\n', (size_t)(end - line));
        const char *le = nl ? nl : end;
        const char *p = line;
        int decl = 0;
        while (p < le && *p == '.') {
            const char *w = p;
            while (p < le && *p != ' ' && *p != '\t') p++;
            size_t n = (size_t)(p - w);
            if ((n == 7 && !memcmp(w, ".global", 7)) || (n == 6 && !memcmp(w, ".const", 6)))
                decl = 1;
            else if (n == 7 && !memcmp(w, ".extern", 7))
                break;
            while (p < le && (*p == ' ' || *p == '\t')) p++;
            if (n == 6 && !memcmp(w, ".align", 6))
                while (p < le && *p >= '0' && *p <= '9') p++;
            while (p < le && (*p == ' ' || *p == '\t')) p++;
        }
        if (decl && p < le && *p != '.') {
            const char *id = p;
            while (p < le && is_ident(*p)) p++;
            if (p > id) cb(id, (size_t)(p - id), arg);
        }
        line = le + 1;
    }
}

static uint64_t rd(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* A 64-bit little-endian ELF (what cubins are): its defined data objects (STT_OBJECT). */
static void elf_names(const unsigned char *e, size_t len, name_cb cb, void *arg) {
    if (len < 64 || e[4] != 2 || e[5] != 1) return;
    uint64_t shoff = rd(e + 40, 8), shentsize = rd(e + 58, 2), shnum = rd(e + 60, 2);
    if (shentsize < 64 || shoff > len || shnum > (len - shoff) / shentsize) return;
    for (uint64_t s = 0; s < shnum; s++) {
        const unsigned char *sh = e + shoff + s * shentsize;
        if (rd(sh + 4, 4) != 2) continue; /* SHT_SYMTAB */
        uint64_t off = rd(sh + 24, 8), size = rd(sh + 32, 8), link = rd(sh + 40, 4), ent = rd(sh + 56, 8);
        if (ent < 24 || off > len || size > len - off || link >= shnum) continue;
        const unsigned char *str = e + shoff + link * shentsize;
        uint64_t soff = rd(str + 24, 8), ssize = rd(str + 32, 8);
        if (soff > len || ssize > len - soff) continue;
        for (uint64_t k = 0; k + ent <= size; k += ent) {
            const unsigned char *sym = e + off + k;
            uint64_t name = rd(sym, 4);
            if ((sym[4] & 0xf) != 1 || rd(sym + 6, 2) == 0 || name >= ssize) continue; /* STT_OBJECT, defined */
            const char *nm = (const char *)e + soff + name;
            size_t nl = strnlen(nm, ssize - name);
            if (nl && nl < ssize - name) cb(nm, nl, arg);
        }
    }
}

static void image_names(const unsigned char *img, size_t len, name_cb cb, void *arg, int depth);

/* A fatbin: 0xBA55ED50, version, header size, payload size; then entries, each a header (kind,
 * header size, payload size, ..., flags at byte 40 telling compressed payloads apart) and its
 * payload (PTX text or an ELF cubin). */
static void fatbin_names(const unsigned char *f, size_t len, name_cb cb, void *arg, int depth) {
    if (len < 16) return;
    uint64_t hs = rd(f + 6, 2), fat = rd(f + 8, 8);
    if (hs < 16 || hs > len || fat > len - hs) return;
    const unsigned char *p = f + hs, *end = f + hs + fat;
    while ((size_t)(end - p) >= 32) {
        uint64_t ehs = rd(p + 4, 4), psize = rd(p + 8, 8);
        if (ehs < 32 || ehs > (size_t)(end - p) || psize > (size_t)(end - p) - ehs) break;
        uint64_t flags = ehs >= 48 ? rd(p + 40, 8) : 0;
        if (!(flags & 0x2000)) image_names(p + ehs, psize, cb, arg, depth + 1); /* 0x2000: compressed */
        p += ehs + psize;
    }
}

static void image_names(const unsigned char *img, size_t len, name_cb cb, void *arg, int depth) {
    if (depth > 2 || len < 4) return;
    if (img[0] == 0x7f && img[1] == 'E' && img[2] == 'L' && img[3] == 'F')
        elf_names(img, len, cb, arg);
    else if (rd(img, 4) == 0xBA55ED50u)
        fatbin_names(img, len, cb, arg, depth);
    else
        ptx_names((const char *)img, len, cb, arg);
}

/* The length of an image given by pointer only: ELF and fatbin headers say; PTX is text. */
static size_t image_len(const unsigned char *img) {
    if (img[0] == 0x7f && img[1] == 'E' && img[2] == 'L' && img[3] == 'F') {
        if (img[4] != 2) return 0;
        uint64_t shoff = rd(img + 40, 8), shentsize = rd(img + 58, 2), shnum = rd(img + 60, 2);
        return (size_t)(shoff + shentsize * shnum);
    }
    if (rd(img, 4) == 0xBA55ED50u) return (size_t)(rd(img + 6, 2) + rd(img + 8, 8));
    return strlen((const char *)img);
}

/* ---- charging ---- */

struct collect {
    struct mod_rec *m;
    get_global_fn get;
    int failed;
};

static void add_global(const char *name, size_t len, void *arg) {
    struct collect *c = arg;
    char buf[512];
    if (c->failed || len >= sizeof buf) return;
    memcpy(buf, name, len);
    buf[len] = 0;
    CUdeviceptr ptr = 0;
    size_t bytes = 0;
    if (c->get(&ptr, &bytes, c->m->handle, buf) != CUDA_SUCCESS || ptr == 0 || bytes == 0) return;
    for (size_t i = 0; i < c->m->n; i++)
        if (c->m->g[i].ptr == ptr) return; /* named twice (a fatbin's PTX and cubin) */
    struct global *g = realloc(c->m->g, (c->m->n + 1) * sizeof *g);
    if (g == NULL) {
        c->failed = 1;
        return;
    }
    c->m->g = g;
    g[c->m->n] = (struct global){.ptr = ptr};
    if (vgpu_mem_take(c->m->dev, bytes, &g[c->m->n].charged, &g[c->m->n].unit) != CUDA_SUCCESS) {
        c->failed = 1;
        return;
    }
    c->m->n++;
}

static void give_back_all(struct mod_rec *m) {
    for (size_t i = 0; i < m->n; i++) vgpu_mem_give_back(m->dev, m->g[i].charged, m->g[i].unit);
    free(m->g);
    free(m);
}

typedef CUresult (*ctx_get_fn)(CUcontext *);
typedef CUresult (*ctx_dev_fn)(CUdevice *);

static int is_primary(CUcontext c, CUdevice d) {
    CUcontext p = NULL;
    unsigned flags;
    int active = 0;
    static void *state_fn;
    if (state_fn == NULL) state_fn = vgpu_cuda_sym("cuDevicePrimaryCtxGetState");
    if (state_fn == NULL || ((CUresult (*)(CUdevice, unsigned *, int *))state_fn)(d, &flags, &active) != CUDA_SUCCESS ||
        !active || real_cuDevicePrimaryCtxRetain == NULL || real_cuDevicePrimaryCtxRetain(&p, d) != CUDA_SUCCESS)
        return 0;
    /* active already: this retain creates nothing, and is given back at once */
    if (real_cuDevicePrimaryCtxRelease_v2)
        real_cuDevicePrimaryCtxRelease_v2(d);
    else if (real_cuDevicePrimaryCtxRelease)
        real_cuDevicePrimaryCtxRelease(d);
    return p == c;
}

/* After a successful load of `handle` from `img`: charge its globals. CUDA_SUCCESS, or
 * CUDA_ERROR_OUT_OF_MEMORY after unloading it. */
static CUresult charge_loaded(void *handle, const void *img, size_t len, const char *getter,
                              CUresult (*unload)(void *)) {
    static void *get_ctx, *get_dev;
    if (get_ctx == NULL) get_ctx = vgpu_cuda_sym("cuCtxGetCurrent");
    if (get_dev == NULL) get_dev = vgpu_cuda_sym("cuCtxGetDevice");
    get_global_fn get = (get_global_fn)vgpu_cuda_sym(getter);
    CUcontext ctx = NULL;
    CUdevice d;
    int dev;
    if (img == NULL || get == NULL || get_ctx == NULL || get_dev == NULL ||
        ((ctx_get_fn)get_ctx)(&ctx) != CUDA_SUCCESS || ((ctx_dev_fn)get_dev)(&d) != CUDA_SUCCESS ||
        (dev = vgpu_device_index(d)) < 0)
        return CUDA_SUCCESS;
    struct mod_rec *m = calloc(1, sizeof *m);
    if (m == NULL) return CUDA_SUCCESS;
    *m = (struct mod_rec){.handle = handle, .ctx = ctx, .dev = dev};
    struct collect c = {.m = m, .get = get};
    image_names(img, len ? len : image_len(img), add_global, &c, 0);
    if (c.failed) {
        give_back_all(m);
        unload(handle);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (m->n == 0) {
        free(m);
        return CUDA_SUCCESS;
    }
    m->primary = is_primary(ctx, d);
    pthread_mutex_lock(&mods_mu);
    m->next = mods;
    mods = m;
    pthread_mutex_unlock(&mods_mu);
    return CUDA_SUCCESS;
}

/* Remove and return the records matching: a handle, or (ctx != NULL) a context, or (dev >= 0) a
 * device's primary context. */
static struct mod_rec *take_recs(void *handle, CUcontext ctx, int dev) {
    struct mod_rec *out = NULL;
    pthread_mutex_lock(&mods_mu);
    for (struct mod_rec **pp = &mods, *m; (m = *pp) != NULL;) {
        int hit = handle ? m->handle == handle : ctx ? m->ctx == ctx : (m->primary && m->dev == dev);
        if (hit) {
            *pp = m->next;
            m->next = out;
            out = m;
        } else {
            pp = &m->next;
        }
    }
    pthread_mutex_unlock(&mods_mu);
    return out;
}

static void release_recs(struct mod_rec *m) {
    while (m) {
        struct mod_rec *next = m->next;
        give_back_all(m);
        m = next;
    }
}

CUresult vgpu_modules_ctx_gone(CUcontext ctx, CUresult rc) {
    if (rc == CUDA_SUCCESS && ctx != NULL) release_recs(take_recs(NULL, ctx, -1));
    return rc;
}

CUresult vgpu_modules_primary_gone(CUdevice d, int reset, CUresult rc) {
    int active = 0, dev = vgpu_device_index(d);
    unsigned flags;
    static void *state_fn;
    if (state_fn == NULL) state_fn = vgpu_cuda_sym("cuDevicePrimaryCtxGetState");
    if (rc != CUDA_SUCCESS || dev < 0) return rc;
    if (!reset && (state_fn == NULL ||
                   ((CUresult (*)(CUdevice, unsigned *, int *))state_fn)(d, &flags, &active) != CUDA_SUCCESS || active))
        return rc; /* still alive (other retains) */
    release_recs(take_recs(NULL, NULL, dev));
    return rc;
}

/* ---- hooks ---- */

static CUresult unload_module(void *h) { return real_cuModuleUnload ? real_cuModuleUnload((CUmodule)h) : CUDA_SUCCESS; }
static CUresult unload_library(void *h) {
    return real_cuLibraryUnload ? real_cuLibraryUnload((CUlibrary)h) : CUDA_SUCCESS;
}

/* cudart's wrapper around a fatbin (__fatBinC_Wrapper_t: magic, version, the fatbin) */
static const void *unwrap(const void *img) {
    const unsigned char *p = img;
    if (p != NULL && rd(p, 4) == 0x466243b1u) return *(const void *const *)(p + 8);
    return img;
}

#define LOAD_HOOK(sym, out, call, img, len, getter, unload)                                                            \
    do {                                                                                                               \
        VGPU_HOOK_OPEN(real_##sym);                                                                                    \
        CUresult rc_ = call;                                                                                           \
        if (rc_ != CUDA_SUCCESS || (out) == NULL || !vgpu_mem_active()) return rc_;                                    \
        return charge_loaded((void *)*(out), (img), (len), (getter), (unload));                                        \
    } while (0)

CUresult hook_cuModuleLoadData(CUmodule *module, const void *image) {
    LOAD_HOOK(cuModuleLoadData, module, real_cuModuleLoadData(module, image), unwrap(image), 0, "cuModuleGetGlobal_v2",
              unload_module);
}

CUresult hook_cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,
                                 void **optionValues) {
    LOAD_HOOK(cuModuleLoadDataEx, module, real_cuModuleLoadDataEx(module, image, numOptions, options, optionValues),
              unwrap(image), 0, "cuModuleGetGlobal_v2", unload_module);
}

CUresult hook_cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
                                unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                unsigned int numLibraryOptions) {
    LOAD_HOOK(cuLibraryLoadData, library,
              real_cuLibraryLoadData(library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                                     libraryOptionValues, numLibraryOptions),
              unwrap(code), 0, "cuLibraryGetGlobal", unload_library);
}

CUresult hook_cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    LOAD_HOOK(cuModuleLoadFatBinary, module, real_cuModuleLoadFatBinary(module, fatCubin), unwrap(fatCubin), 0,
              "cuModuleGetGlobal_v2", unload_module);
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = path ? fopen(path, "rb") : NULL;
    if (f == NULL) return NULL;
    char *b = NULL;
    long n;
    if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) > 0 && n < (1L << 30) && fseek(f, 0, SEEK_SET) == 0 &&
        (b = calloc(1, (size_t)n + 1)) != NULL && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) *len = (size_t)n;
    return b;
}

/* A module loaded from a file: the driver read it, so the names are in it. */
static CUresult charge_file(void *handle, const char *path, const char *getter, CUresult (*unload)(void *)) {
    size_t len = 0;
    char *img = read_file(path, &len);
    CUresult rc = charge_loaded(handle, img, len, getter, unload);
    free(img);
    return rc;
}

CUresult hook_cuModuleLoad(CUmodule *module, const char *fname) {
    VGPU_HOOK_OPEN(real_cuModuleLoad);
    CUresult rc = real_cuModuleLoad(module, fname);
    if (rc != CUDA_SUCCESS || module == NULL || !vgpu_mem_active()) return rc;
    return charge_file((void *)*module, fname, "cuModuleGetGlobal_v2", unload_module);
}

CUresult hook_cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                    void **jitOptionsValues, unsigned int numJitOptions,
                                    CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                    unsigned int numLibraryOptions) {
    VGPU_HOOK_OPEN(real_cuLibraryLoadFromFile);
    CUresult rc = real_cuLibraryLoadFromFile(library, fileName, jitOptions, jitOptionsValues, numJitOptions,
                                             libraryOptions, libraryOptionValues, numLibraryOptions);
    if (rc != CUDA_SUCCESS || library == NULL || !vgpu_mem_active()) return rc;
    return charge_file((void *)*library, fileName, "cuLibraryGetGlobal", unload_library);
}

CUresult hook_cuModuleUnload(CUmodule hmod) {
    VGPU_HOOK_OPEN(real_cuModuleUnload);
    CUresult rc = real_cuModuleUnload(hmod);
    if (rc == CUDA_SUCCESS && hmod != NULL) release_recs(take_recs(hmod, NULL, -1));
    return rc;
}

CUresult hook_cuLibraryUnload(CUlibrary library) {
    VGPU_HOOK_OPEN(real_cuLibraryUnload);
    CUresult rc = real_cuLibraryUnload(library);
    if (rc == CUDA_SUCCESS && library != NULL) release_recs(take_recs(library, NULL, -1));
    return rc;
}

/*
 * Module globals (__device__ and __constant__ variables). The simulator runs no device code but a
 * module's variables are device memory the real driver allocates at load, charged to the device
 * and reachable through cuModuleGetGlobal. A PTX image (text: NVRTC's and numba's output) declares
 * them as `[.visible|.weak] .global|.const [.align N] .<type> name[dims] [= init];`; each is
 * allocated (zeroed, charged like cuMemAlloc) in the module's context and freed at unload. An ELF
 * cubin (NVRTC's and nvcc's device code) names them in its symbol table: data objects in its
 * .nv.global (zero-initialised) and .nv.constant<N> sections, with their sizes. A fat binary's
 * globals are those of its cubin for the device (fatbin.c); a module loads them at load, a
 * library at its first cuLibraryGetGlobal (the real driver loads a library lazily too).
 */
#include "modglobals.h"

#include "fatbin.h"
#include "init.h"
#include "memory.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GLOBALS 4096

static size_t type_size(const char *t, size_t n) {
    /* .b8 .u16 .s32 .f64 .pred ... : the digits are the bit width */
    if (n >= 2 && (t[0] == 'b' || t[0] == 'u' || t[0] == 's' || t[0] == 'f')) {
        size_t bits = 0;
        for (size_t i = 1; i < n; i++) {
            if (!isdigit((unsigned char)t[i])) return 0;
            bits = bits * 10 + (size_t)(t[i] - '0');
        }
        return bits == 8 || bits == 16 || bits == 32 || bits == 64 ? bits / 8 : 0;
    }
    return 0;
}

static const char *skip_ws(const char *p) {
    while (*p == ' ' || *p == '\t') p++;
    return p;
}

/* Parse one declaration line starting at a `.global`/`.const` directive. 0 if not a variable. */
static int parse_decl(const char *p, char *name, size_t namecap, size_t *size) {
    size_t elem = 0;
    for (;;) {
        p = skip_ws(p);
        if (*p != '.') break;
        const char *w = ++p;
        while (isalnum((unsigned char)*p) || *p == '_') p++;
        size_t n = (size_t)(p - w);
        if (n == 5 && strncmp(w, "align", 5) == 0) {
            p = skip_ws(p);
            while (isdigit((unsigned char)*p)) p++;
            continue;
        }
        size_t ts = type_size(w, n);
        if (ts) elem = ts;
    }
    if (!elem) return 0;
    const char *id = p;
    while (isalnum((unsigned char)*p) || *p == '_' || *p == '$') p++;
    size_t idn = (size_t)(p - id);
    if (idn == 0 || idn >= namecap) return 0;
    memcpy(name, id, idn);
    name[idn] = 0;
    size_t total = elem;
    while (*p == '[') {
        p++;
        size_t d = 0;
        if (*p == ']') d = 1; /* size from the initializer: not counted, at least one element */
        while (isdigit((unsigned char)*p)) {
            if (d > (1ull << 40)) return 0;
            d = d * 10 + (size_t)(*p++ - '0');
        }
        if (*p++ != ']' || d == 0 || total > (1ull << 40) / d) return 0;
        total *= d;
    }
    *size = total;
    return 1;
}

static int is_ptx(const unsigned char *img) {
    /* byte by byte: a short NUL-terminated image must not be read past its end */
    if ((img[0] == 0x7f && img[1] == 'E' && img[2] == 'L' && img[3] == 'F') ||
        (img[0] == 0x50 && img[1] == 0xed && img[2] == 0x55 && img[3] == 0xba))
        return 0;
    /* PTX is NUL-terminated text with a .version directive near the top */
    for (size_t i = 0; i < 65536 && img[i]; i++)
        if (img[i] == '.' && strncmp((const char *)img + i, ".version", 8) == 0) return 1;
    return 0;
}

static CUresult add_global(struct CUmod_st *m, const char *name, size_t size) {
    if (m->nglobals >= MAX_GLOBALS) return CUDA_ERROR_INVALID_IMAGE;
    CUdeviceptr ptr;
    CUresult rc = sim_alloc_memory(&ptr, size, ALLOC_MODULE, 0);
    if (rc != CUDA_SUCCESS) return rc;
    memset((void *)(uintptr_t)ptr, 0, size);
    struct CUmod_global *g = realloc(m->globals, (m->nglobals + 1) * sizeof *g);
    if (g) m->globals = g;
    char *n = g ? strdup(name) : NULL;
    if (!n) {
        pthread_mutex_lock(&G.lock);
        sim_alloc a;
        if (sim_alloc_remove((uintptr_t)ptr, &a) == 0) sim_alloc_release_locked(&a);
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->globals[m->nglobals++] = (struct CUmod_global){.name = n, .ptr = ptr, .size = size};
    return CUDA_SUCCESS;
}

static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* A 64-bit little-endian ELF cubin: STT_OBJECT symbols of its .nv.global / .nv.constant<N>
 * sections. The image's size is not given: the section header table ends it. */
static CUresult elf_globals(struct CUmod_st *m, const unsigned char *e) {
    if (e[4] != 2 || e[5] != 1) return CUDA_SUCCESS;
    uint64_t shoff = le(e + 40, 8), shentsize = le(e + 58, 2), shnum = le(e + 60, 2), shstrndx = le(e + 62, 2);
    if (shentsize < 64 || shstrndx >= shnum || shoff > (1ull << 32)) return CUDA_SUCCESS;
    const unsigned char *sh = e + shoff;
    uint64_t len = shoff + shnum * shentsize; /* everything else lies before the section headers */
    const unsigned char *names = sh + shstrndx * shentsize;
    uint64_t noff = le(names + 24, 8), nsize = le(names + 32, 8);
    if (noff > len || nsize > len - noff) return CUDA_SUCCESS;
    for (uint64_t s = 0; s < shnum; s++) {
        const unsigned char *tab = sh + s * shentsize;
        if (le(tab + 4, 4) != 2) /* SHT_SYMTAB */
            continue;
        uint64_t off = le(tab + 24, 8), size = le(tab + 32, 8), link = le(tab + 40, 4), ent = le(tab + 56, 8);
        if (ent < 24 || off > len || size > len - off || link >= shnum) continue;
        const unsigned char *str = sh + link * shentsize;
        uint64_t soff = le(str + 24, 8), ssize = le(str + 32, 8);
        if (soff > len || ssize > len - soff) continue;
        for (uint64_t k = 0; k + ent <= size; k += ent) {
            const unsigned char *sym = e + off + k;
            uint64_t name = le(sym, 4), shndx = le(sym + 6, 2), bytes = le(sym + 16, 8);
            if ((sym[4] & 0xf) != 1 || shndx == 0 || shndx >= shnum || name >= ssize || bytes == 0 ||
                bytes > (1ull << 40))
                continue;
            uint64_t secname = le(sh + shndx * shentsize, 4);
            if (secname >= nsize) continue;
            const char *sec = (const char *)e + noff + secname, *nm = (const char *)e + soff + name;
            size_t seclen = strnlen(sec, nsize - secname), nml = strnlen(nm, ssize - name);
            int data = (seclen >= 10 && strncmp(sec, ".nv.global", 10) == 0) ||
                       (seclen >= 12 && strncmp(sec, ".nv.constant", 12) == 0 && sec[12] != '0');
            if (!data || nml == 0 || nml >= 256 || nml == ssize - name) continue;
            CUresult rc = add_global(m, nm, (size_t)bytes);
            if (rc != CUDA_SUCCESS) return rc;
        }
    }
    return CUDA_SUCCESS;
}

CUresult sim_module_globals_fatbin(struct CUmod_st *m, const void *image, int sm) {
    unsigned char *cubin = sim_fatbin_cubin(image, sm);
    if (!cubin) return CUDA_SUCCESS; /* PTX only, or not decodable here: no globals */
    CUresult rc = elf_globals(m, cubin);
    free(cubin);
    return rc;
}

CUresult sim_module_globals(struct CUmod_st *m, const void *image) {
    const unsigned char *img = image;
    if (sim_fatbin_header(image)) {
        const sim_device_cfg *d = &G.cfg->dev[m->ctx->dev];
        return sim_module_globals_fatbin(m, image, d->cc_major * 10 + d->cc_minor);
    }
    if (img[0] == 0x7f && img[1] == 'E' && img[2] == 'L' && img[3] == 'F') return elf_globals(m, img);
    if (!is_ptx(img)) return CUDA_SUCCESS;
    for (const char *line = (const char *)img; line && *line;) {
        const char *end = strchr(line, '\n');
        const char *p = line; /* module-scope declarations start the line (function bodies are indented) */
        while (strncmp(p, ".visible", 8) == 0 || strncmp(p, ".weak", 5) == 0) p = skip_ws(p + (p[1] == 'v' ? 8 : 5));
        size_t dir = strncmp(p, ".global", 7) == 0 ? 7 : strncmp(p, ".const", 6) == 0 ? 6 : 0;
        char name[256];
        size_t size;
        if (dir && (p[dir] == ' ' || p[dir] == '\t') && parse_decl(p + dir, name, sizeof name, &size)) {
            CUresult rc = add_global(m, name, size);
            if (rc != CUDA_SUCCESS) return rc;
        }
        line = end ? end + 1 : NULL;
    }
    return CUDA_SUCCESS;
}

/*
 * One object's own symbol lookup (elfsym.h): the object's hash table (GNU, else SysV), its
 * symbol and string tables, and its version definitions, read from its dynamic section as the
 * dynamic linker left them in memory. The rules for picking a definition are the dynamic
 * linker's (glibc elf/dl-lookup.c, check_match): defined, global or weak, not hidden by version;
 * dlsym's choice without a version, dlvsym's with one. Anything the dynamic linker would have
 * to compute itself (an indirect function, a thread-local variable, an absolute symbol) is
 * answered ASK_DLSYM, and the caller asks it.
 */
#include <elf.h>
#include <link.h>
#include <stddef.h>
#include <stdint.h>

#include "elfsym.h"

/* Nothing here may be instrumented or call the C library: dispatch.c's dlsym and dlvsym run it
 * while a sanitizer runtime preloaded before the shim resolves its own interceptors. */
#define EARLY_SAFE __attribute__((no_sanitize_address, no_sanitize("undefined")))

EARLY_SAFE static int streq(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

/* Most dynamic linkers relocate the dynamic section's addresses in place, a few (and the vDSO)
 * leave them as offsets: an object's own offsets are always below its load address. */
EARLY_SAFE static uintptr_t at(uintptr_t base, ElfW(Addr) p) { return p < base ? base + p : p; }

EARLY_SAFE int vgpu_elf_open(struct vgpu_elf *e, uintptr_t base, const ElfW(Dyn) * dynamic) {
    *e = (struct vgpu_elf){.base = base};
    if (dynamic == NULL) return -1;
    for (const ElfW(Dyn) *d = dynamic; d->d_tag != DT_NULL; d++) {
        switch (d->d_tag) {
        case DT_SYMTAB: e->symtab = (const ElfW(Sym) *)at(base, d->d_un.d_ptr); break;
        case DT_STRTAB: e->strtab = (const char *)at(base, d->d_un.d_ptr); break;
        case DT_GNU_HASH: e->gnu_hash = (const uint32_t *)at(base, d->d_un.d_ptr); break;
        case DT_HASH: e->sysv_hash = (const uint32_t *)at(base, d->d_un.d_ptr); break;
        case DT_VERSYM: e->versym = (const ElfW(Half) *)at(base, d->d_un.d_ptr); break;
        case DT_VERDEF: e->verdef = (const ElfW(Verdef) *)at(base, d->d_un.d_ptr); break;
        default: break;
        }
    }
    if (e->symtab == NULL || e->strtab == NULL || (e->gnu_hash == NULL && e->sysv_hash == NULL)) return -1;
    return 0;
}

/* The name of version index `ndx` among the object's definitions (not its base), or NULL. */
EARLY_SAFE static const char *version_name(const struct vgpu_elf *e, ElfW(Half) ndx) {
    const ElfW(Verdef) *v = e->verdef;
    while (v != NULL) {
        if ((v->vd_flags & VER_FLG_BASE) == 0 && (v->vd_ndx & 0x7fff) == ndx) {
            const ElfW(Verdaux) *aux = (const ElfW(Verdaux) *)((const char *)v + v->vd_aux);
            return e->strtab + aux->vda_name;
        }
        if (v->vd_next == 0) break;
        v = (const ElfW(Verdef) *)((const char *)v + v->vd_next);
    }
    return NULL;
}

struct pick {
    const char *name, *version;
    enum vgpu_elf_match how;
    const ElfW(Sym) * sym; /* the answer so far */
    int exact;             /* an unversioned definition (dlsym) or the version asked (dlvsym): final */
    int defaults;          /* dlsym: non-hidden versioned definitions seen */
};

/* Symbol `i` of the object, whose name matched: is it the definition asked for? */
EARLY_SAFE static void consider(const struct vgpu_elf *e, uint32_t i, struct pick *p) {
    const ElfW(Sym) *s = &e->symtab[i];
    unsigned type = ELF64_ST_TYPE(s->st_info), bind = ELF64_ST_BIND(s->st_info);
    if (s->st_shndx == SHN_UNDEF || (bind != STB_GLOBAL && bind != STB_WEAK && bind != STB_GNU_UNIQUE)) return;
    if (type != STT_FUNC && type != STT_OBJECT && type != STT_NOTYPE && type != STT_COMMON && type != STT_GNU_IFUNC &&
        type != STT_TLS)
        return;
    if (s->st_value == 0 && s->st_shndx != SHN_ABS && type != STT_TLS) return;
    ElfW(Half) v = e->versym ? e->versym[i] : 1, ndx = v & 0x7fff;
    if (p->how != VGPU_ELF_DLSYM) {
        if (e->versym == NULL || (ndx < 2 && p->how == VGPU_ELF_REFERENCE))
            p->sym = s, p->exact = 1;
        else if (ndx >= 2) {
            const char *vn = version_name(e, ndx);
            if (vn != NULL && streq(vn, p->version)) p->sym = s, p->exact = 1;
        }
        return;
    }
    if (ndx < 2) {
        p->sym = s, p->exact = 1;
        return;
    }
    if ((v & 0x8000) == 0 && p->defaults++ == 0) p->sym = s;
}

EARLY_SAFE static void search(const struct vgpu_elf *e, struct pick *p) {
    const unsigned char *n = (const unsigned char *)p->name;
    if (e->gnu_hash != NULL) {
        const uint32_t *h = e->gnu_hash;
        uint32_t nbuckets = h[0], symoffset = h[1], bloom_size = h[2], bloom_shift = h[3];
        if (nbuckets == 0 || bloom_size == 0) return;
        const ElfW(Addr) *bloom = (const ElfW(Addr) *)&h[4];
        const uint32_t *buckets = (const uint32_t *)&bloom[bloom_size], *chain = &buckets[nbuckets];
        uint32_t hash = 5381;
        for (const unsigned char *c = n; *c; c++) hash = hash * 33 + *c;
        const unsigned bits = sizeof(ElfW(Addr)) * 8;
        ElfW(Addr) word = bloom[(hash / bits) % bloom_size];
        ElfW(Addr) mask = ((ElfW(Addr))1 << (hash % bits)) | ((ElfW(Addr))1 << ((hash >> bloom_shift) % bits));
        if ((word & mask) != mask) return;
        uint32_t i = buckets[hash % nbuckets];
        if (i < symoffset) return;
        for (;; i++) {
            uint32_t h2 = chain[i - symoffset];
            if ((h2 | 1) == (hash | 1) && streq(p->name, e->strtab + e->symtab[i].st_name)) {
                consider(e, i, p);
                if (p->exact) return;
            }
            if (h2 & 1) return;
        }
    }
    if (e->sysv_hash == NULL) return;
    const uint32_t *h = e->sysv_hash;
    uint32_t nbucket = h[0], nchain = h[1], hash = 0;
    if (nbucket == 0) return;
    for (const unsigned char *c = n; *c; c++) {
        hash = (hash << 4) + *c;
        uint32_t g = hash & 0xf0000000u;
        if (g) hash ^= g >> 24;
        hash &= ~g;
    }
    const uint32_t *chain = &h[2 + nbucket];
    for (uint32_t i = h[2 + hash % nbucket], steps = 0; i != STN_UNDEF && i < nchain && steps < nchain;
         i = chain[i], steps++) {
        if (streq(p->name, e->strtab + e->symtab[i].st_name)) {
            consider(e, i, p);
            if (p->exact) return;
        }
    }
}

EARLY_SAFE int vgpu_elf_find(const struct vgpu_elf *e, const char *name, const char *version, enum vgpu_elf_match how,
                             void **addr) {
    struct pick p = {name, version, version != NULL ? how : VGPU_ELF_DLSYM, NULL, 0, 0};
    search(e, &p);
    if (p.sym == NULL || (!p.exact && p.defaults > 1)) return p.defaults > 1 ? VGPU_ELF_ASK_DLSYM : VGPU_ELF_ABSENT;
    unsigned type = ELF64_ST_TYPE(p.sym->st_info);
    if (type == STT_GNU_IFUNC || type == STT_TLS || p.sym->st_shndx == SHN_ABS) return VGPU_ELF_ASK_DLSYM;
    *addr = (void *)(e->base + p.sym->st_value);
    return VGPU_ELF_FOUND;
}

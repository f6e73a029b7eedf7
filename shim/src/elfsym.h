/*
 * A symbol lookup in one loaded object's own dynamic symbol table (elfsym.c), without the
 * dynamic linker: what dispatch.c uses to find the C library's dlvsym without binding to the
 * shim's own export, and the driver's ~100 entry points at a fraction of one dlsym each.
 * Calls no C library function (it runs while sanitizer runtimes initialise).
 */
#ifndef VGPU_ELFSYM_H
#define VGPU_ELFSYM_H

#include <link.h>
#include <stdint.h>

struct vgpu_elf {
    uintptr_t base; /* load bias (l_addr / dlpi_addr) */
    const ElfW(Sym) * symtab;
    const char *strtab;
    const uint32_t *gnu_hash;    /* DT_GNU_HASH, or NULL */
    const uint32_t *sysv_hash;   /* DT_HASH, or NULL (used only without DT_GNU_HASH) */
    const ElfW(Half) * versym;   /* DT_VERSYM, or NULL: the object defines no versions */
    const ElfW(Verdef) * verdef; /* DT_VERDEF, or NULL */
};

/* Reads the object's dynamic section. 0, or -1 if it has no usable symbol table and hash. */
int vgpu_elf_open(struct vgpu_elf *e, uintptr_t base, const ElfW(Dyn) * dynamic);

enum { VGPU_ELF_FOUND = 1, VGPU_ELF_ABSENT = 0, VGPU_ELF_ASK_DLSYM = -1 };

/* How a version is matched: */
enum vgpu_elf_match {
    VGPU_ELF_DLSYM,     /* version NULL: unversioned, else the one non-hidden default version */
    VGPU_ELF_DLVSYM,    /* exactly name@version (an object that defines no versions: any) */
    VGPU_ELF_REFERENCE, /* as a reference to name@version binds: also an unversioned definition */
};

/* The object's own definition of `name`. FOUND sets *addr; ASK_DLSYM: only the dynamic linker
 * can answer (an indirect function's resolver, a thread-local variable, two default versions). */
int vgpu_elf_find(const struct vgpu_elf *e, const char *name, const char *version, enum vgpu_elf_match how,
                  void **addr);

#endif

/*
 * The driver's functions: real_<symbol> for every entry of hooks.def, resolved from the driver
 * libraries by their own symbol tables (elfsym.c) where those answer, other driver functions by
 * name, and the C library's own dlsym and dlvsym (the shim exports its own: dispatch.c).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "symbols.h"
#include "compat.h"
#include "elfsym.h"
#include "shim_internal.h"

/* ---- the real driver functions ---- */
#define VGPU_HOOK(lib, ret, name, params, args) vgpu_pfn_##name real_##name;
#include "hooks.def"
#undef VGPU_HOOK

const struct vgpu_symbol vgpu_symbols[] = {
#define VGPU_HOOK(lib, ret, name, params, args) {#name, VGPU_LIB_##lib, (void **)&real_##name},
#include "hooks.def"
#undef VGPU_HOOK
};
const size_t vgpu_n_symbols = sizeof vgpu_symbols / sizeof vgpu_symbols[0];

/* ---- the real dlsym and dlvsym ---- */
typedef vgpu_dlsym_fn dlsym_fn;
typedef vgpu_dlvsym_fn dlvsym_fn;
static _Atomic(dlsym_fn) real_dlsym_ptr;
static _Atomic(dlvsym_fn) real_dlvsym_ptr;

/* dispatch.c's dlsym and dlvsym call these before anything is set up (sanitizer runtimes and
 * other preloads resolve their own symbols through dlsym while they initialise): no
 * instrumented code, no intercepted libc function. */
#define EARLY_SAFE VGPU_EARLY_SAFE

/* dlsym's versions, newest first: libc.so.6's since glibc 2.34, before that libdl.so.2's at the
 * architecture's first ABI (GLIBC_2.2.5 on x86-64, GLIBC_2.17 on aarch64: glibc_compat.h). The
 * newer glibc keeps the old one too, so either finds it there. */
static const char *const dlsym_versions[] = {
    "GLIBC_2.34",
#ifdef VGPU_GLIBC_BASE
    VGPU_GLIBC_BASE,
#endif
};
#define N_DLSYM_VERSIONS (sizeof dlsym_versions / sizeof dlsym_versions[0])

/* Without the C library's dlsym the shim can neither find the driver nor answer the program's
 * dlsym: every lookup answers NULL and cuInit fails (fail closed), with this one line. Written
 * with the system call: this can run while a sanitizer runtime initialises. */
EARLY_SAFE void vgpu_report_no_dlsym(void) {
    static atomic_int reported;
    if (atomic_exchange(&reported, 1)) return;
    static const char msg[] =
        "vgpu: cannot resolve the C library's dlsym (dlvsym found none of its versions: GLIBC_2.34"
#ifdef VGPU_GLIBC_BASE
        ", " VGPU_GLIBC_BASE
#endif
        "): every dlsym answers NULL and CUDA calls fail\n";
    long r = syscall(SYS_write, 2, msg, sizeof msg - 1);
    (void)r;
}

/* The C library's dlvsym. The shim exports its own dlvsym (below), so a reference of the shim's
 * to dlvsym would bind to that export: instead the objects loaded at start-up are searched in
 * the dynamic linker's order (the link map, which starts with them; the shim itself skipped)
 * for the first definition a reference to dlvsym@<first ABI> would bind to, as the dynamic linker
 * itself would have bound it without the shim's export. The objects before the C library are
 * start-up objects, which are never unloaded, so the walk needs no lock. */
static struct vgpu_elf dlvsym_object; /* where find_dlvsym found it */
static atomic_int dlvsym_object_ok;

EARLY_SAFE static dlvsym_fn find_dlvsym(void) {
    /* the version the normal build's reference would name (glibc_compat.h); a build without
     * that header (the test harness) binds to the newest */
#ifdef VGPU_GLIBC_BASE
    static const char version[] = VGPU_GLIBC_BASE;
#else
    static const char version[] = "GLIBC_2.34";
#endif
    for (const struct link_map *m = _r_debug.r_map; m != NULL; m = m->l_next) {
        if (m->l_ld == _DYNAMIC) continue; /* the shim */
        struct vgpu_elf e;
        void *f;
        if (vgpu_elf_open(&e, m->l_addr, m->l_ld) == 0 &&
            vgpu_elf_find(&e, "dlvsym", version, VGPU_ELF_REFERENCE, &f) == VGPU_ELF_FOUND) {
            dlvsym_object = e;
            atomic_store(&dlvsym_object_ok, 1);
            return (dlvsym_fn)f;
        }
    }
    return NULL;
}

/* A glibc older than 2.34 keeps dlvsym and dlsym in libdl.so.2, which the shim does not load
 * (compat.c): a process that did not load it at start (no program linked with the driver is
 * one: the driver needs it) has it loaded by compat.c, outside the start-up scope where
 * RTLD_NEXT looks: then both are taken from its symbol table. */
EARLY_SAFE dlvsym_fn vgpu_real_dlvsym(void) {
    dlvsym_fn f = atomic_load_explicit(&real_dlvsym_ptr, memory_order_acquire);
    if (f) return f;
    f = find_dlvsym(); /* idempotent, so a race only searches twice */
#ifdef VGPU_GLIBC_BASE
    if (f == NULL) f = (dlvsym_fn)vgpu_compat_dl_sym("dlvsym", VGPU_GLIBC_BASE);
#endif
    if (f != NULL) atomic_store_explicit(&real_dlvsym_ptr, f, memory_order_release);
    return f;
}

EARLY_SAFE dlsym_fn vgpu_real_dlsym(void) {
    dlsym_fn f = atomic_load_explicit(&real_dlsym_ptr, memory_order_acquire);
    if (f) return f;
    /* RTLD_NEXT from here is the C library's dlsym. Idempotent, so a race resolves it twice. */
    dlvsym_fn vsym = vgpu_real_dlvsym();
    for (size_t i = 0; vsym != NULL && f == NULL && i < N_DLSYM_VERSIONS; i++)
        f = (dlsym_fn)vsym(RTLD_NEXT, "dlsym", dlsym_versions[i]);
    /* Nothing after the shim: the C library was loaded before it (libdl.so.2 preloaded ahead of
     * the shim on an old glibc), or compat.c loaded libdl outside the start-up scope: the dlsym
     * of the very object whose dlvsym this is (a dlvsym that answers nothing stays alone). */
    void *d = NULL;
    for (size_t i = 0; vsym != NULL && f == NULL && atomic_load(&dlvsym_object_ok) && i < N_DLSYM_VERSIONS; i++)
        if (vgpu_elf_find(&dlvsym_object, "dlsym", dlsym_versions[i], VGPU_ELF_DLVSYM, &d) == VGPU_ELF_FOUND)
            f = (dlsym_fn)d;
#ifdef VGPU_GLIBC_BASE
    if (f == NULL && vsym != NULL && vgpu_compat_libdl_loaded_here())
        f = (dlsym_fn)vgpu_compat_dl_sym("dlsym", VGPU_GLIBC_BASE);
#endif
    if (f == NULL) {
        vgpu_report_no_dlsym();
        return NULL;
    }
    atomic_store_explicit(&real_dlsym_ptr, f, memory_order_release);
    return f;
}

/* ---- resolution ---- */

EARLY_SAFE int vgpu_driver_name(const char *name) {
    return (name[0] == 'c' && name[1] == 'u') || (name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l');
}

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT, nvml_once = PTHREAD_ONCE_INIT;
static int cuda_ok, nvml_ok;
static void *cuda_handle, *nvml_handle;

/* The thread inside resolve_lib of each library: a driver library's constructor that looks one
 * of its names up must not wait for the resolution it runs in (pthread_once would never return). */
static _Atomic int resolving[2];
static pthread_t resolving_thread[2];

int vgpu_resolving_here(int lib) {
    return atomic_load_explicit(&resolving[lib], memory_order_acquire) &&
           pthread_equal(resolving_thread[lib], pthread_self());
}

/* Each driver library's own symbol table (elfsym.c): its entry points are looked up there, a
 * fraction of one dlsym each, and dlsym answers only what the table cannot (an indirect
 * function). Found from the object that defines the library's first hooked name. */
static struct vgpu_elf lib_table[2];
static int lib_table_ok[2];

struct find_object {
    uintptr_t addr;
    struct vgpu_elf *table;
    int found;
};

int vgpu_object_contains(const struct dl_phdr_info *info, uintptr_t addr) {
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t start = info->dlpi_addr + ph->p_vaddr;
        if (ph->p_type == PT_LOAD && addr >= start && addr - start < ph->p_memsz) return 1;
    }
    return 0;
}

static int find_object_step(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct find_object *f = data;
    if (!vgpu_object_contains(info, f->addr)) return 0;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            f->found = vgpu_elf_open(f->table, info->dlpi_addr,
                                     (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr)) == 0;
    return 1;
}

static void open_table(int lib, void *h, dlsym_fn sym) {
    for (size_t i = 0; i < vgpu_n_symbols; i++) {
        if (vgpu_symbols[i].lib != lib) continue;
        void *anchor = sym(h, vgpu_symbols[i].name);
        if (anchor == NULL) return;
        struct find_object f = {(uintptr_t)anchor, &lib_table[lib], 0};
        dl_iterate_phdr(find_object_step, &f);
        void *check;
        /* the table must give the anchor back, or it is not the one dlsym reads */
        lib_table_ok[lib] =
            f.found &&
            vgpu_elf_find(&lib_table[lib], vgpu_symbols[i].name, NULL, VGPU_ELF_DLSYM, &check) == VGPU_ELF_FOUND &&
            check == anchor;
        return;
    }
}

/* dlsym(h, name) of a driver library `lib`, through its own table where that can answer. */
static void *lib_sym(int lib, void *h, dlsym_fn sym, const char *name) {
    void *a = NULL;
    if (lib_table_ok[lib]) {
        int r = vgpu_elf_find(&lib_table[lib], name, NULL, VGPU_ELF_DLSYM, &a);
        if (r == VGPU_ELF_FOUND) return a;
        if (r == VGPU_ELF_ABSENT && vgpu_driver_name(name)) return NULL; /* no dependency defines a driver name */
    }
    return sym(h, name);
}

static void resolve_lib(int lib, const char *soname, int *ok) {
    resolving_thread[lib] = pthread_self();
    atomic_store_explicit(&resolving[lib], 1, memory_order_release);
    /* RTLD_LOCAL: do not add the driver to the global scope ahead of anything; by name, so an
     * application that already loaded it (even by absolute path) shares this one instance */
    void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    atomic_store_explicit(&resolving[lib], 0, memory_order_release);
    if (h == NULL) return;
    if (lib == VGPU_LIB_CUDA)
        cuda_handle = h;
    else
        nvml_handle = h;
    dlsym_fn sym = vgpu_real_dlsym();
    if (sym == NULL) return; /* not ok: cuInit fails closed */
    open_table(lib, h, sym);
    for (size_t i = 0; i < vgpu_n_symbols; i++)
        if (vgpu_symbols[i].lib == lib) *vgpu_symbols[i].real = lib_sym(lib, h, sym, vgpu_symbols[i].name);
    *ok = 1;
}

static void resolve_cuda_once(void) { resolve_lib(VGPU_LIB_CUDA, "libcuda.so.1", &cuda_ok); }
static void resolve_nvml_once(void) { resolve_lib(VGPU_LIB_NVML, "libnvidia-ml.so.1", &nvml_ok); }

int vgpu_resolve_cuda(void) {
    pthread_once(&cuda_once, resolve_cuda_once);
    return cuda_ok ? 0 : -1;
}

int vgpu_resolve_nvml(void) {
    pthread_once(&nvml_once, resolve_nvml_once);
    return nvml_ok ? 0 : -1;
}

/* (resolve_lib succeeds only with the real dlsym: it is not NULL after these checks) */
void *vgpu_cuda_sym(const char *name) {
    return vgpu_resolve_cuda() == 0 ? lib_sym(VGPU_LIB_CUDA, cuda_handle, vgpu_real_dlsym(), name) : NULL;
}

void *vgpu_nvml_sym(const char *name) {
    return vgpu_resolve_nvml() == 0 ? lib_sym(VGPU_LIB_NVML, nvml_handle, vgpu_real_dlsym(), name) : NULL;
}

/* The C library's definition of `name` (the next one after the shim), NULL without a dlsym. */
void *vgpu_libc_sym(const char *name) {
    dlsym_fn real = vgpu_real_dlsym();
    return real != NULL ? real(RTLD_NEXT, name) : NULL;
}

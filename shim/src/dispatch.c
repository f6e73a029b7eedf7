/*
 * Everything generated from hooks.def: the real_<symbol> pointers and their resolution, the
 * exported wrappers, and the two maps that make the other call routes reach the hooks:
 *   dlsym(handle_of_driver, "symbol")   -> our wrapper of exactly that symbol (any handle whose
 *     answer is the driver's definition; RTLD_NEXT from an object loaded after the shim)
 *   cuGetProcAddress(_v2)(base, version, flags) -> the driver answers (it is the authority on
 *     versions); an answer equal to real_<symbol> becomes the wrapper of that same symbol.
 * Symbols not in hooks.def are never touched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "elfsym.h"
#include "shim_internal.h"

/* ---- the real driver functions ---- */
#define VGPU_HOOK(lib, ret, name, params, args) vgpu_pfn_##name real_##name;
#include "hooks.def"
#undef VGPU_HOOK

/* ---- the exported wrappers, with hidden aliases so our own maps take their address directly
 * (not through the GOT, which an interposer loaded before us could redirect) ---- */
#define VGPU_HOOK(lib, ret, name, params, args)                                                                        \
    VGPU_EXPORT ret name params { return hook_##name args; }                                                           \
    extern __typeof__(name) vgpu_wrap_##name __attribute__((alias(#name), visibility("hidden")));
#include "hooks.def"
#undef VGPU_HOOK

enum { VGPU_LIB_CUDA, VGPU_LIB_NVML };

struct entry {
    const char *name;
    int lib;
    void **real;
    void *wrapper;
};

static const struct entry entries[] = {
#define VGPU_HOOK(lib, ret, name, params, args)                                                                        \
    {#name, VGPU_LIB_##lib, (void **)&real_##name, (void *)&vgpu_wrap_##name},
#include "hooks.def"
#undef VGPU_HOOK
};
#define N_ENTRIES (sizeof entries / sizeof entries[0])

/* ---- the real dlsym and dlvsym ---- */
typedef void *(*dlsym_fn)(void *, const char *);
typedef void *(*dlvsym_fn)(void *, const char *, const char *);
static _Atomic(dlsym_fn) real_dlsym_ptr;
static _Atomic(dlvsym_fn) real_dlvsym_ptr;

/* dlsym runs before anything is set up (sanitizer runtimes and other preloads resolve their own
 * symbols through it while they initialise): its passthrough path touches no instrumented code,
 * calls no intercepted libc function, and must stay a tail call (RTLD_NEXT is relative to the
 * caller's address, so the real dlsym must see the application's return address, not ours).
 * The same holds for dlvsym. */
#define EARLY_SAFE __attribute__((no_sanitize_address, no_sanitize("undefined")))

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
EARLY_SAFE static void report_no_dlsym(void) {
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
EARLY_SAFE static dlvsym_fn real_dlvsym(void) {
    dlvsym_fn f = atomic_load_explicit(&real_dlvsym_ptr, memory_order_acquire);
    if (f) return f;
    f = find_dlvsym(); /* idempotent, so a race only searches twice */
#ifdef VGPU_GLIBC_BASE
    if (f == NULL) f = (dlvsym_fn)vgpu_compat_dl_sym("dlvsym", VGPU_GLIBC_BASE);
#endif
    if (f != NULL) atomic_store_explicit(&real_dlvsym_ptr, f, memory_order_release);
    return f;
}

EARLY_SAFE static dlsym_fn real_dlsym(void) {
    dlsym_fn f = atomic_load_explicit(&real_dlsym_ptr, memory_order_acquire);
    if (f) return f;
    /* RTLD_NEXT from here is the C library's dlsym. Idempotent, so a race resolves it twice. */
    dlvsym_fn vsym = real_dlvsym();
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
        report_no_dlsym();
        return NULL;
    }
    atomic_store_explicit(&real_dlsym_ptr, f, memory_order_release);
    return f;
}

/* ---- resolution ---- */

/* A name the driver libraries define (cu*, nvml*): the only names the shim maps. */
EARLY_SAFE static int maybe_ours(const char *name) {
    return (name[0] == 'c' && name[1] == 'u') || (name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l');
}

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT, nvml_once = PTHREAD_ONCE_INIT;
static int cuda_ok, nvml_ok;
static void *cuda_handle, *nvml_handle;

/* The thread inside resolve_lib of each library: a driver library's constructor that looks one
 * of its names up must not wait for the resolution it runs in (pthread_once would never return). */
static _Atomic int resolving[2];
static pthread_t resolving_thread[2];

static int resolving_here(int lib) {
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

static int object_contains(const struct dl_phdr_info *info, uintptr_t addr);

static int find_object_step(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct find_object *f = data;
    if (!object_contains(info, f->addr)) return 0;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            f->found = vgpu_elf_open(f->table, info->dlpi_addr,
                                     (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr)) == 0;
    return 1;
}

static void open_table(int lib, void *h, dlsym_fn sym) {
    for (size_t i = 0; i < N_ENTRIES; i++) {
        if (entries[i].lib != lib) continue;
        void *anchor = sym(h, entries[i].name);
        if (anchor == NULL) return;
        struct find_object f = {(uintptr_t)anchor, &lib_table[lib], 0};
        dl_iterate_phdr(find_object_step, &f);
        void *check;
        /* the table must give the anchor back, or it is not the one dlsym reads */
        lib_table_ok[lib] =
            f.found &&
            vgpu_elf_find(&lib_table[lib], entries[i].name, NULL, VGPU_ELF_DLSYM, &check) == VGPU_ELF_FOUND &&
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
        if (r == VGPU_ELF_ABSENT && maybe_ours(name)) return NULL; /* no dependency defines a driver name */
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
    dlsym_fn sym = real_dlsym();
    if (sym == NULL) return; /* not ok: cuInit fails closed */
    open_table(lib, h, sym);
    for (size_t i = 0; i < N_ENTRIES; i++)
        if (entries[i].lib == lib) *entries[i].real = lib_sym(lib, h, sym, entries[i].name);
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
    return vgpu_resolve_cuda() == 0 ? lib_sym(VGPU_LIB_CUDA, cuda_handle, real_dlsym(), name) : NULL;
}

void *vgpu_nvml_sym(const char *name) {
    return vgpu_resolve_nvml() == 0 ? lib_sym(VGPU_LIB_NVML, nvml_handle, real_dlsym(), name) : NULL;
}

/* The C library's definition of `name` (the next one after the shim), NULL without a dlsym. */
void *vgpu_libc_sym(const char *name) {
    dlsym_fn real = real_dlsym();
    return real != NULL ? real(RTLD_NEXT, name) : NULL;
}

static void *vgpu_map_dlsym(const char *name, void *r);

static const struct entry *entry_by_name(const char *name) {
    for (size_t i = 0; i < N_ENTRIES; i++)
        if (strcmp(entries[i].name, name) == 0) return &entries[i];
    return NULL;
}

/* ---- dlsym ---- */

__attribute__((noinline)) static void *vgpu_next_hook(const char *name, const void *caller);

/* The tail call must not depend on the optimisation level the shim is built with. */
EARLY_SAFE __attribute__((optimize("optimize-sibling-calls"))) VGPU_EXPORT void *dlsym(void *handle, const char *name) {
    dlsym_fn real = real_dlsym();
    if (real == NULL) return NULL; /* reported once; nothing to pass through to */
    /* <dlfcn.h> declares name nonnull, but applications do pass NULL: launder the pointer so the
     * compiler keeps the check, and leave the NULL to the real dlsym */
    __asm__("" : "+r"(name));
    /* anything that is not a driver name is none of our business */
    if (name == NULL || !maybe_ours(name)) return real(handle, name);
    if (handle == RTLD_NEXT) {
        /* RTLD_NEXT depends on the caller's address: the hook if the caller was loaded after us,
         * otherwise a tail call so the real dlsym sees the application as its caller */
        void *hook = vgpu_next_hook(name, __builtin_return_address(0));
        if (hook != NULL) return hook;
        return real(handle, name);
    }
    return vgpu_map_dlsym(name, real(handle, name));
}

__attribute__((noinline)) static void *vgpu_next_vhook(const char *name, const char *version, const void *caller);

/* dlvsym routes to the hooks as dlsym does. The driver's entry points carry no symbol version
 * (the C library's dlvsym then answers NULL for them), but a driver whose symbols are versioned
 * would hand its definitions out through dlvsym, which the shim's unversioned exports never
 * answer: every answer that is the driver's definition of a hooked name becomes its hook. */
EARLY_SAFE __attribute__((optimize("optimize-sibling-calls"))) VGPU_EXPORT void *dlvsym(void *handle, const char *name,
                                                                                        const char *version) {
    dlvsym_fn real = real_dlvsym();
    if (real == NULL) {
        report_no_dlsym();
        return NULL;
    }
    __asm__("" : "+r"(name));
    if (name == NULL || !maybe_ours(name)) return real(handle, name, version);
    if (handle == RTLD_NEXT) {
        void *hook = vgpu_next_vhook(name, version, __builtin_return_address(0));
        if (hook != NULL) return hook;
        return real(handle, name, version);
    }
    return vgpu_map_dlsym(name, real(handle, name, version));
}

/* Control is on and `e`'s library resolved: the wrapper may be handed out. */
static int hooks_apply(const struct entry *e) {
    if (resolving_here(e->lib)) return 0;
    if (e->lib == VGPU_LIB_CUDA ? vgpu_resolve_cuda() : vgpu_resolve_nvml()) return 0;
    (void)vgpu_init(); /* CUDA_DISABLE_CONTROL=true: the driver's own pointers (pure passthrough) */
    return !vgpu_config()->disabled;
}

/* the part of dlsym for driver names: ordinary (instrumented) code */
static void *vgpu_map_dlsym(const char *name, void *r) {
    if (r == NULL) return r;
    const struct entry *e = entry_by_name(name);
    if (e == NULL || !hooks_apply(e)) return r;
    /* exactly the driver's definition of exactly this name becomes our wrapper of this name */
    return r == *e->real ? e->wrapper : r;
}

/* Where the caller sits in the load order relative to the shim (dl_iterate_phdr walks the
 * objects in that order, under the loader's lock, so no object goes away during the walk). */
struct load_order {
    uintptr_t caller, self;
    int self_seen, caller_after_self;
};

static int object_contains(const struct dl_phdr_info *info, uintptr_t addr) {
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t start = info->dlpi_addr + ph->p_vaddr;
        if (ph->p_type == PT_LOAD && addr >= start && addr - start < ph->p_memsz) return 1;
    }
    return 0;
}

static int load_order_step(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct load_order *o = data;
    if (object_contains(info, o->self)) {
        o->self_seen = 1;
        return object_contains(info, o->caller); /* the shim itself: stop, not after */
    }
    if (!object_contains(info, o->caller)) return 0;
    o->caller_after_self = o->self_seen;
    return 1;
}

static int loaded_after_shim(const void *caller) {
    struct load_order o = {(uintptr_t)caller, (uintptr_t)&vgpu_wrap_cuInit, 0, 0};
    dl_iterate_phdr(load_order_step, &o);
    return o.caller_after_self;
}

/* A driver library already in the process (dlsym must not load one as a side effect). */
static int lib_loaded(const struct entry *e) {
    void *h = dlopen(e->lib == VGPU_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL) return 0;
    dlclose(h);
    return 1;
}

/* dlsym(RTLD_NEXT, name) from `caller`. A caller loaded after the shim (a library dlopen'ed
 * later, a later preload, a dependency of the program) looks behind the shim, where the driver's
 * unhooked definition is: it gets the hook of exactly that name whenever the loaded driver
 * defines it. The C library computes RTLD_NEXT from the caller's address and offers no call that
 * takes it, so the answer the caller would have had is not recomputed: an interposer loaded
 * after the shim is skipped (as it is on every other route, the shim coming first), and a
 * caller whose scope lacks the driver gets the hook instead of NULL. Callers loaded before the
 * shim (the program, earlier preloads) get NULL here: the real dlsym answers them exactly. */
static void *vgpu_next_hook(const char *name, const void *caller) {
    const struct entry *e = entry_by_name(name);
    if (e == NULL || !lib_loaded(e) || !loaded_after_shim(caller) || !hooks_apply(e)) return NULL;
    return *e->real != NULL ? e->wrapper : NULL;
}

/* dlvsym(RTLD_NEXT, name, version) from `caller`: a caller after the shim as for dlsym. Before
 * the shim the shim's exports are no answer to a versioned lookup, so the search goes on past
 * them: what follows the shim is asked (from here), and the driver's definition becomes the
 * hook (an object between the caller and the shim defining name@version is passed over then:
 * it would only have been another interposer of a hooked name). NULL: ask for the caller. */
static void *vgpu_next_vhook(const char *name, const char *version, const void *caller) {
    void *hook = vgpu_next_hook(name, caller);
    if (hook != NULL || version == NULL) return hook;
    void *r = real_dlvsym()(RTLD_NEXT, name, version);
    void *m = vgpu_map_dlsym(name, r);
    return m != r ? m : NULL;
}

/* ---- cuGetProcAddress ---- */

/* What the ABI table says a request resolves to (vgpu/cuda_procaddr.def), NULL if no row. */
static const char *procaddr_symbol(const char *base, int version, cuuint64_t flags) {
    const char *best = NULL;
    int best_ver = -1;
#define CU_PROC(b, ver, sym, ptds)                                                                                     \
    if (strcmp(base, #b) == 0 && ver <= version && ver > best_ver) {                                                   \
        best_ver = ver;                                                                                                \
        best = (sizeof(#ptds) > 1 && (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)) ? #ptds : #sym;          \
    }
#include "vgpu/cuda_procaddr.def"
#undef CU_PROC
    return best;
}

static void map_procaddr(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    if (pfn == NULL || *pfn == NULL) return;
    const struct vgpu_config *cfg = vgpu_config();
    if (cfg != NULL && cfg->disabled) return; /* pure passthrough */
    for (size_t i = 0; i < N_ENTRIES; i++) {
        if (entries[i].lib == VGPU_LIB_CUDA && *entries[i].real == *pfn) {
            *pfn = entries[i].wrapper;
            return;
        }
    }
    /* A driver may answer with an internal entry point rather than its exported symbol: then
     * the ABI table names the versioned symbol asked for, and that symbol's hook answers. */
    if (symbol == NULL) return;
    const char *exact = procaddr_symbol(symbol, version, flags);
    const struct entry *e = exact ? entry_by_name(exact) : NULL;
    if (e != NULL && e->lib == VGPU_LIB_CUDA) *pfn = e->wrapper;
}

CUresult hook_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult *symbolStatus) {
    if (vgpu_resolve_cuda() != 0 || real_cuGetProcAddress_v2 == NULL) return CUDA_ERROR_NOT_INITIALIZED;
    (void)vgpu_init(); /* for the passthrough switch; a config error is reported by the hooks */
    CUresult rc = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS) map_procaddr(symbol, pfn, cudaVersion, flags);
    return rc;
}

CUresult hook_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    if (vgpu_resolve_cuda() != 0 || real_cuGetProcAddress == NULL) return CUDA_ERROR_NOT_INITIALIZED;
    (void)vgpu_init();
    CUresult rc = real_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS) map_procaddr(symbol, pfn, cudaVersion, flags);
    return rc;
}

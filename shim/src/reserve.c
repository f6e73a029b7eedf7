/*
 * Charging device memory: every allocation path reserves what the driver takes in the accounting
 * file before the memory is taken, and gives it back when it is freed.
 *
 * What the driver takes is learned from the driver, per device, at the first allocation: its
 * page size G (cuMemGetAllocationGranularity, minimum) and its allocation alignment A
 * (CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT). As NVIDIA's driver allocates, an allocation of at
 * least G/2 takes whole pages of its own (charged its size rounded up to G) and a smaller one is
 * sub-allocated, in units of A, from pages the process's small allocations share: the process
 * is charged whole pages for them (a page more when their sum crosses a page boundary, a page
 * back when it falls below one). Where the driver does not answer, every allocation is charged
 * in whole pages of what it does report (never less than the driver takes).
 * cuMemAllocPitch's row pitch is the driver's choice: its alignment P is learned from the
 * pitches the driver returns (starting from A).
 * No size or alignment of any particular driver is written here.
 *
 * A refusal first asks every cache that holds charges it can give back (pools.c, graphmem.c:
 * they register a settle function when they first hold one) and retries: this file calls none
 * of them by name.
 */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>

#include "reserve.h"
#include "burst.h"
#include "config.h"
#include "devices.h"
#include "log.h"
#include "region.h"
#include "symbols.h"

/* Where the driver answers nothing about its allocation unit: the smallest unit CUDA documents
 * (cudaMalloc's 256-byte alignment). */
#define DOCUMENTED_MIN_ALIGN 256ULL

int vgpu_mem_active(void) { return vgpu_region() != NULL && !vgpu_config()->disabled; }

/* ---- what plugs in: caches that give charges back, the charge of the runtime's contexts ---- */

#define MAX_SETTLE 4 /* pools.c and graphmem.c */
static vgpu_mem_settle_fn settle_fns[MAX_SETTLE];
static _Atomic int n_settle;
static pthread_mutex_t settle_mu = PTHREAD_MUTEX_INITIALIZER;
static void (*before_charge)(int dev);

void vgpu_mem_add_settle(vgpu_mem_settle_fn fn) {
    pthread_mutex_lock(&settle_mu);
    int n = atomic_load_explicit(&n_settle, memory_order_relaxed);
    int known = 0;
    for (int i = 0; i < n; i++) known |= settle_fns[i] == fn;
    if (!known && n < MAX_SETTLE) {
        settle_fns[n] = fn;
        atomic_store_explicit(&n_settle, n + 1, memory_order_release); /* published after the slot */
    }
    pthread_mutex_unlock(&settle_mu);
}

int vgpu_mem_settle(int dev, int trim) {
    int released = 0, n = atomic_load_explicit(&n_settle, memory_order_acquire);
    for (int i = 0; i < n; i++) released |= settle_fns[i](dev, trim) != 0;
    return released;
}

void vgpu_mem_before_charge(void (*fn)(int dev)) { __atomic_store_n(&before_charge, fn, __ATOMIC_RELEASE); }

/* ---- what the driver takes: learned per device ---- */

typedef CUresult (*gran_fn)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
typedef CUresult (*attr_fn)(int *, CUdevice_attribute, CUdevice);
static struct {
    pthread_mutex_t mu;
    uint64_t page, unit; /* G and A; 0 until learned */
    uint64_t pitch;      /* P: the pitch alignment seen in the driver's answers (0: none yet) */
    uint64_t small_live; /* bytes of the process's sub-allocated (small) allocations, in units */
} takes[VGPU_MAX_DEVICES];
static pthread_once_t takes_once = PTHREAD_ONCE_INIT;
static void takes_init(void) {
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) pthread_mutex_init(&takes[i].mu, NULL);
}

/* takes[dev].mu held: ask the driver about device index dev */
static void learn_locked(int dev) {
    if (takes[dev].page != 0) return;
    gran_fn gran = (gran_fn)vgpu_cuda_sym("cuMemGetAllocationGranularity");
    attr_fn attr = (attr_fn)vgpu_cuda_sym("cuDeviceGetAttribute");
    CUdevice d;
    size_t g = 0;
    int a = 0;
    if (vgpu_device_handle(dev, &d) != 0) return;
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = d;
    if (gran == NULL || gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) g = 0;
    if (attr == NULL || attr(&a, CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, d) != CUDA_SUCCESS) a = 0;
    if (g == 0 && a <= 0) return; /* nothing learned: ask again next time */
    /* one missing answer: the other one is used for both (whole units, never less than taken) */
    takes[dev].page = g ? g : (uint64_t)a;
    takes[dev].unit = a > 0 && (uint64_t)a <= takes[dev].page ? (uint64_t)a : takes[dev].page;
}

static uint64_t round_to(uint64_t n, uint64_t g) {
    if (g <= 1) return n;
    if (n > UINT64_MAX - (g - 1)) return UINT64_MAX;
    return (n + g - 1) / g * g;
}

static uint64_t pages_of(uint64_t bytes, uint64_t page) { return round_to(bytes, page) / page; }

/* Reserve what an allocation of `size` on device `dev` takes. *unit: its share of the shared
 * pages if it is sub-allocated (0 if it has pages of its own); *charged: bytes reserved now. */
static CUresult take(int dev, uint64_t size, uint64_t *charged, uint64_t *unit) {
    pthread_once(&takes_once, takes_init);
    pthread_mutex_lock(&takes[dev].mu);
    learn_locked(dev);
    uint64_t g = takes[dev].page, a = takes[dev].unit;
    CUresult rc;
    *unit = 0;
    if (g == 0) { /* the driver told us nothing */
        *charged = round_to(size, DOCUMENTED_MIN_ALIGN);
        rc = vgpu_mem_reserve(dev, *charged);
    } else if (g > a && size < g / 2) {
        uint64_t u = round_to(size, a), live = takes[dev].small_live;
        *charged = (pages_of(live + u, g) - pages_of(live, g)) * g;
        rc = *charged ? vgpu_mem_reserve(dev, *charged) : CUDA_SUCCESS;
        if (rc == CUDA_SUCCESS) {
            takes[dev].small_live = live + u;
            *unit = u;
        }
    } else {
        *charged = round_to(size, g);
        rc = vgpu_mem_reserve(dev, *charged);
    }
    pthread_mutex_unlock(&takes[dev].mu);
    return rc;
}

/* Give back what take() reserved: `bytes` for an allocation with pages of its own, or the pages
 * its sub-allocated `unit` no longer fills. */
static void give_back(int dev, uint64_t bytes, uint64_t unit) {
    if (unit == 0) {
        vgpu_mem_release(dev, bytes);
        return;
    }
    pthread_once(&takes_once, takes_init);
    pthread_mutex_lock(&takes[dev].mu);
    uint64_t g = takes[dev].page, live = takes[dev].small_live;
    uint64_t after = live > unit ? live - unit : 0;
    takes[dev].small_live = after;
    uint64_t back = g ? (pages_of(live, g) - pages_of(after, g)) * g : 0;
    pthread_mutex_unlock(&takes[dev].mu);
    if (back) vgpu_mem_release(dev, back);
}

/* The device's page G as learned from the driver (0: it answered nothing). */
uint64_t vgpu_mem_page(int dev) {
    pthread_once(&takes_once, takes_init);
    pthread_mutex_lock(&takes[dev].mu);
    learn_locked(dev);
    uint64_t g = takes[dev].page;
    pthread_mutex_unlock(&takes[dev].mu);
    return g;
}

uint64_t vgpu_mem_estimate(int dev, uint64_t size) {
    pthread_once(&takes_once, takes_init);
    pthread_mutex_lock(&takes[dev].mu);
    learn_locked(dev);
    uint64_t g = takes[dev].page, a = takes[dev].unit;
    pthread_mutex_unlock(&takes[dev].mu);
    if (g == 0) return round_to(size, DOCUMENTED_MIN_ALIGN);
    return g > a && size < g / 2 ? round_to(size, a) : round_to(size, g);
}

CUresult vgpu_mem_unaccounted(void) {
    if (!vgpu_config()->any_limit) return CUDA_SUCCESS;
    static atomic_flag said = ATOMIC_FLAG_INIT;
    if (!atomic_flag_test_and_set(&said))
        vgpu_log(VGPU_LOG_WARN,
                 "device ordinal %d: memory refused: a memory limit is set and only the first %d devices of a "
                 "process are accounted",
                 vgpu_device_unaccounted_ordinal(), VGPU_MAX_DEVICES);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Charge bytes on dev against what the slice may use now: its request, or while it bursts its
 * request plus its grant. A charge that took the slice above its request reads the grant again
 * after a full fence; if the plugin lowered it meanwhile below what the slice now uses, the
 * charge is undone: the plugin writes the grant, fences, then reads the slice's usage, so of the
 * two at least one sees the other's write (docs/policy.md, "The pool file"). */
#ifdef VGPU_TEST_HOOKS
void (*vgpu_test_after_charge)(int dev); /* tests/c/shim_harness.c: the plugin acts here */
#endif

int vgpu_mem_charge_bounded(int dev, uint64_t bytes, uint64_t *used_out) {
    uint64_t bound = vgpu_burst_bound(dev), request = vgpu_region_limit(dev);
    int rc = vgpu_region_charge(dev, bytes, bound, used_out);
#ifdef VGPU_TEST_HOOKS
    if (rc == 0 && vgpu_test_after_charge != NULL) vgpu_test_after_charge(dev);
#endif
    if (rc == 0 && bound != request && *used_out + bytes > request) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        uint64_t now = vgpu_burst_bound(dev);
        if (vgpu_region_used(dev) > now) {
            vgpu_region_uncharge(dev, bytes);
            vgpu_region_count_denial(dev, bytes);
            rc = -1;
        }
    }
    return rc;
}

uint64_t vgpu_mem_shown_total(int dev) {
    return vgpu_config()->show_limit && vgpu_burst_on(dev) ? vgpu_burst_limit(dev) : vgpu_region_limit(dev);
}

uint64_t vgpu_mem_allowed_now(int dev) {
    return vgpu_config()->show_limit ? vgpu_burst_bound(dev) : vgpu_region_limit(dev);
}

CUresult vgpu_mem_reserve(int dev, uint64_t bytes) {
    void (*adopt)(int) = __atomic_load_n(&before_charge, __ATOMIC_ACQUIRE);
    if (adopt != NULL) adopt(dev); /* a context the CUDA runtime retained out of sight is charged first */
    uint64_t used = 0;
    int rc = vgpu_mem_charge_bounded(dev, bytes, &used);
    /* before refusing: memory our pools merely cache goes back to the device, then retry */
    if (rc == -1 && vgpu_mem_settle(dev, 1)) rc = vgpu_mem_charge_bounded(dev, bytes, &used);
    if (rc == 0) return CUDA_SUCCESS;
    if (rc == -2) return CUDA_ERROR_OPERATING_SYSTEM; /* region unusable: reported already */
    static atomic_flag said = ATOMIC_FLAG_INIT;
    if (!atomic_flag_test_and_set(&said)) {
        char want[32], u[32], l[32], b[32];
        uint64_t limit = vgpu_region_limit(dev), bound = vgpu_burst_bound(dev);
        vgpu_format_bytes(bytes, want, sizeof want);
        vgpu_format_bytes(used, u, sizeof u);
        vgpu_format_bytes(limit, l, sizeof l);
        vgpu_format_bytes(bound - limit, b, sizeof b);
        if (vgpu_burst_on(dev))
            vgpu_log(VGPU_LOG_WARN, "device %d: %s denied, slice uses %s of %s requested + %s borrowable now", dev,
                     want, u, l, b);
        else
            vgpu_log(VGPU_LOG_WARN, "device %d: %s denied, slice uses %s of %s", dev, want, u, l);
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

void vgpu_mem_release(int dev, uint64_t bytes) { vgpu_region_uncharge(dev, bytes); }

/* ---- cuMemAllocPitch: the pitch alignment P ---- */

/* The pitch the driver is expected to choose for width (P learned so far, else A). */
uint64_t vgpu_mem_pitch_expected(int dev, uint64_t width) {
    pthread_once(&takes_once, takes_init);
    pthread_mutex_lock(&takes[dev].mu);
    learn_locked(dev);
    uint64_t p = takes[dev].pitch ? takes[dev].pitch : takes[dev].unit;
    pthread_mutex_unlock(&takes[dev].mu);
    return round_to(width, p ? p : DOCUMENTED_MIN_ALIGN);
}

/* The driver answered pitch for width: the alignment is the smallest power of two that rounds
 * width to pitch, among those dividing pitch, searched from the one assumed so far (from 1 if
 * that one was too coarse). */
void vgpu_mem_pitch_learn(int dev, uint64_t width, uint64_t pitch) {
    pthread_mutex_lock(&takes[dev].mu);
    uint64_t p = takes[dev].pitch ? takes[dev].pitch : (takes[dev].unit ? takes[dev].unit : 1);
    if (round_to(width, p) != pitch) {
        for (uint64_t q = round_to(width, p) > pitch ? 1 : p; q && q <= pitch && pitch % q == 0; q <<= 1)
            if (round_to(width, q) == pitch) {
                p = q;
                break;
            }
    }
    takes[dev].pitch = p;
    pthread_mutex_unlock(&takes[dev].mu);
}

/* What an allocation of `size` takes, reserved / given back as cuMemAlloc's are. */
CUresult vgpu_mem_take(int dev, uint64_t size, uint64_t *charged, uint64_t *unit) {
    return take(dev, size, charged, unit);
}
void vgpu_mem_give_back(int dev, uint64_t bytes, uint64_t unit) { give_back(dev, bytes, unit); }

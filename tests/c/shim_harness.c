/*
 * Test harness linked with the shim's own sources (not preloaded): exercises the parts that need
 * no driver. Modes:
 *   parse STR...                 one line per STR: "OK <bytes>" or "ERR <why>"
 *   cap                          the env's compute cap of device 0: "OK <permille, 0 = none>" or "ERR"
 *   config                       load the env config: "OK any_limit=<0|1> limit0=<n> ... " or exit 3
 *   stress PATH DEV LIMIT THREADS ITERS
 *                                random charge/uncharge on the region at PATH against LIMIT;
 *                                checks used <= LIMIT after every charge; everything returned at the end
 *   hold PATH DEV BYTES          charge BYTES, print "held", then sleep forever (to be SIGKILLed)
 *   lockdie PATH                 take the region lock and die by SIGKILL while holding it
 *   used PATH DEV                print the device's used bytes after a dead-slot scan
 *   burstrace POOL BYTES LOWER   (built with -DVGPU_TEST_HOOKS) the env's bursting slice charges
 *                                BYTES on device 0; if LOWER is 1, the "plugin" lowers the device's
 *                                grant to 0 between the charge and its check, as a plugin racing
 *                                the allocation would: "rc=.. used=.. bound=.."
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fcntl.h>
#include <sys/mman.h>

#include "burst.h"
#include "compute.h"
#include "config.h"
#include "pool_io.h"
#include "reserve.h"
#include "region.h"
#include "settings.h"

/* The region alone, without vgpu_init (which needs a driver): limits are passed explicitly. */
static int open_region(const char *path) {
    struct vgpu_region_params p = {.path = path};
    vgpu_settings_publish(&p.limits_source, &p.limits_dev, &p.limits_ino, &p.limits_hash);
    return vgpu_region_open(&p) == CUDA_SUCCESS ? 0 : -1;
}

struct stress_arg {
    int dev;
    uint64_t limit;
    long iters;
    unsigned seed;
    int failed;
};

static void *stress_thread(void *p) {
    struct stress_arg *a = p;
    uint64_t held[16] = {0};
    int n = 0;
    for (long i = 0; i < a->iters; i++) {
        if (n < 16 && (rand_r(&a->seed) & 1)) {
            uint64_t b = 1 + (uint64_t)(rand_r(&a->seed) % (a->limit / 8));
            uint64_t used;
            int rc = vgpu_region_charge(a->dev, b, a->limit, &used);
            if (rc == 0) {
                held[n++] = b;
                uint64_t now = vgpu_region_used(a->dev);
                if (now > a->limit) {
                    fprintf(stderr, "over quota: %llu > %llu\n", (unsigned long long)now, (unsigned long long)a->limit);
                    a->failed = 1;
                }
            } else if (rc != -1) {
                a->failed = 1;
            }
        } else if (n > 0) {
            vgpu_region_uncharge(a->dev, held[--n]);
        }
    }
    while (n > 0) vgpu_region_uncharge(a->dev, held[--n]);
    return NULL;
}

#ifdef VGPU_TEST_HOOKS
extern void (*vgpu_test_after_charge)(int dev);
static struct vgpu_pool_grant *race_grant;
static uint64_t race_key;
static void lower_grant(int dev) {
    (void)dev;
    vgpu_pool_grant_write(race_grant, race_key, 0, VGPU_GRANT_RECLAIM, 0, 0, 0, 0);
}

static int burst_race(const char *pool_path, uint64_t bytes, int lower) {
    if (vgpu_config_load() != 0) return 3;
    const struct vgpu_config *c = vgpu_config();
    struct vgpu_region_params p = {.path = c->region_path};
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) p.limit[d] = c->limit[d];
    vgpu_settings_publish(&p.limits_source, &p.limits_dev, &p.limits_ino, &p.limits_hash);
    if (vgpu_region_open(&p) != CUDA_SUCCESS || vgpu_burst_open() != 0) return 3;
    int fd = open(pool_path, O_RDWR | O_CLOEXEC);
    struct vgpu_pool *pool = fd < 0 ? MAP_FAILED : mmap(NULL, sizeof *pool, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (pool == MAP_FAILED) return 3;
    race_grant = &pool->grants[c->burst_entry[0]];
    race_key = c->burst_key[0];
    if (lower) vgpu_test_after_charge = lower_grant;
    uint64_t used = 0;
    int rc = vgpu_mem_charge_bounded(0, bytes, &used);
    printf("rc=%d used=%llu bound=%llu\n", rc, (unsigned long long)vgpu_region_used(0),
           (unsigned long long)vgpu_burst_bound(0));
    return 0;
}
#endif

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    if (!strcmp(argv[1], "parse")) {
        for (int i = 2; i < argc; i++) {
            uint64_t v;
            const char *why;
            if (vgpu_parse_bytes(argv[i], &v, &why) == 0)
                printf("OK %llu\n", (unsigned long long)v);
            else
                printf("ERR %s\n", why);
        }
        return 0;
    }
    if (!strcmp(argv[1], "cap")) { /* the compute cap of device 0 as the environment sets it */
        if (vgpu_config_load() != 0 || vgpu_compute_init() != 0) {
            printf("ERR\n");
            return 0;
        }
        printf("OK %u\n", vgpu_compute_cap_permille(0));
        return 0;
    }
    if (!strcmp(argv[1], "enforced")) { /* what the shim's setup takes from the environment */
        if (vgpu_config_load() != 0 || vgpu_compute_init() != 0) return 3;
        const struct vgpu_enforced *e = &vgpu_config()->enforced;
        printf("disabled=%d policy=%u priority=%d", e->disabled, e->policy, e->priority);
        for (int i = 0; i < VGPU_MAX_DEVICES; i++)
            printf(" mem%d=%llu cap%d=%u", i, (unsigned long long)e->memory[i], i, vgpu_compute_cap_permille(i));
        printf("\n");
        return 0;
    }
    if (!strcmp(argv[1], "config")) {
        if (vgpu_config_load() != 0) return 3;
        const struct vgpu_config *c = vgpu_config();
        printf("OK disabled=%d any_limit=%d", c->disabled, c->any_limit);
        for (int i = 0; i < 4; i++) printf(" limit%d=%llu", i, (unsigned long long)c->limit[i]);
        printf(" reserve=%llu log=%d\n", (unsigned long long)c->context_reserve, c->log_level);
        return 0;
    }
    if (!strcmp(argv[1], "stress") && argc == 7) {
        if (open_region(argv[2]) != 0) return 3;
        int dev = atoi(argv[3]), threads = atoi(argv[5]);
        uint64_t limit = strtoull(argv[4], NULL, 10);
        long iters = atol(argv[6]);
        pthread_t t[64];
        struct stress_arg a[64];
        for (int i = 0; i < threads && i < 64; i++) {
            a[i] = (struct stress_arg){dev, limit, iters, (unsigned)(getpid() * 131 + i), 0};
            pthread_create(&t[i], NULL, stress_thread, &a[i]);
        }
        int failed = 0;
        for (int i = 0; i < threads && i < 64; i++) {
            pthread_join(t[i], NULL);
            failed |= a[i].failed;
        }
        printf("done failed=%d\n", failed);
        return failed;
    }
    if (!strcmp(argv[1], "hold") && argc == 5) {
        if (open_region(argv[2]) != 0) return 3;
        uint64_t used;
        if (vgpu_region_charge(atoi(argv[3]), strtoull(argv[4], NULL, 10), 0, &used) != 0) return 4;
        printf("held\n");
        fflush(stdout);
        for (;;) pause();
    }
    if (!strcmp(argv[1], "charge") && argc == 6) { /* one charge against a limit, then exit */
        if (open_region(argv[2]) != 0) return 3;
        uint64_t used;
        int rc = vgpu_region_charge(atoi(argv[3]), strtoull(argv[4], NULL, 10), strtoull(argv[5], NULL, 10), &used);
        printf("%s total=%llu\n", rc == 0 ? "granted" : "refused", (unsigned long long)vgpu_region_used(atoi(argv[3])));
        return rc == 0 ? 0 : 5;
    }
    if (!strcmp(argv[1], "lockdie") && argc == 3) {
        if (open_region(argv[2]) != 0) return 3;
        uint64_t used;
        vgpu_region_charge(0, 4096, 0, &used);
        vgpu_region_lock();
        /* die inside the critical section with the total out of step with the slots */
        vgpu_region()->devices[0].used += 12345;
        raise(SIGKILL);
    }
#ifdef VGPU_TEST_HOOKS
    if (!strcmp(argv[1], "burstrace") && argc == 5)
        return burst_race(argv[2], strtoull(argv[3], NULL, 10), atoi(argv[4]));
#endif
    if (!strcmp(argv[1], "used") && argc == 4) {
        if (open_region(argv[2]) != 0) return 3;
        vgpu_region_reclaim_dead();
        printf("%llu\n", (unsigned long long)vgpu_region_used(atoi(argv[3])));
        return 0;
    }
    return 2;
}

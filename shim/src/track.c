/*
 * The process's own record of what it charged: (kind, key) -> (device index, bytes), so a free
 * returns exactly what its allocation took, to the device it took it from.
 * Sharded chained hash: allocations on different threads rarely contend on one shard lock.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "track.h"

#define SHARDS            64
#define BUCKETS_PER_SHARD 256

struct node {
    struct node *next;
    uint64_t key;
    uint64_t bytes;
    uint64_t aux;
    int kind;
    int dev;
};

static struct shard {
    pthread_mutex_t mu;
    struct node *buckets[BUCKETS_PER_SHARD];
    struct node *spare; /* freed nodes kept for reuse: no malloc/free per allocation */
    int nspare;
} shards[SHARDS] = {[0 ... SHARDS - 1] = {.mu = PTHREAD_MUTEX_INITIALIZER}};
/* Statically initialised, not by a loop at the first allocation: the table spans 33 pages that a
 * loop would fault in (and glibc's initialiser is all zeros, so it stays in .bss): a process pays
 * only for the shards it uses. */

#define MAX_SPARE 64

static uint64_t mix(int kind, uint64_t key) {
    uint64_t h = key ^ ((uint64_t)kind << 56);
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return h;
}

static struct shard *shard_of(uint64_t h) { return &shards[h % SHARDS]; }
static struct node **bucket_of(struct shard *s, uint64_t h) { return &s->buckets[(h / SHARDS) % BUCKETS_PER_SHARD]; }

int vgpu_track_add(int kind, uint64_t key, int dev, uint64_t bytes) {
    return vgpu_track_add_aux(kind, key, dev, bytes, 0);
}

int vgpu_track_add_aux(int kind, uint64_t key, int dev, uint64_t bytes, uint64_t aux) {
    uint64_t h = mix(kind, key);
    struct shard *s = shard_of(h);
    pthread_mutex_lock(&s->mu);
    struct node *n = s->spare;
    if (n != NULL) {
        s->spare = n->next;
        s->nspare--;
    } else if ((n = malloc(sizeof *n)) == NULL) {
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    n->key = key;
    n->aux = aux;
    n->kind = kind;
    n->dev = dev;
    n->bytes = bytes;
    struct node **b = bucket_of(s, h);
    n->next = *b;
    *b = n;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* remove: 1 take the record, 0 leave it, -1 leave it with *aux as its new aux word */
static int lookup(int kind, uint64_t key, int *dev, uint64_t *bytes, uint64_t *aux, int remove) {
    uint64_t h = mix(kind, key);
    struct shard *s = shard_of(h);
    pthread_mutex_lock(&s->mu);
    struct node **pp = bucket_of(s, h), *n;
    while ((n = *pp) != NULL && !(n->key == key && n->kind == kind)) pp = &n->next;
    int found = n != NULL;
    if (n != NULL) {
        if (dev) *dev = n->dev;
        if (bytes) *bytes = n->bytes;
        if (remove < 0)
            n->aux = *aux;
        else if (aux)
            *aux = n->aux;
        if (remove > 0) {
            *pp = n->next;
            if (s->nspare < MAX_SPARE) {
                n->next = s->spare;
                s->spare = n;
                s->nspare++;
                n = NULL; /* kept */
            }
        }
    }
    pthread_mutex_unlock(&s->mu);
    if (n != NULL && remove > 0) free(n);
    return found;
}

int vgpu_track_take(int kind, uint64_t key, int *dev, uint64_t *bytes) {
    return lookup(kind, key, dev, bytes, NULL, 1);
}
int vgpu_track_take_aux(int kind, uint64_t key, int *dev, uint64_t *bytes, uint64_t *aux) {
    return lookup(kind, key, dev, bytes, aux, 1);
}
int vgpu_track_peek_aux(int kind, uint64_t key, int *dev, uint64_t *bytes, uint64_t *aux) {
    return lookup(kind, key, dev, bytes, aux, 0);
}
int vgpu_track_set_aux(int kind, uint64_t key, uint64_t aux) { return lookup(kind, key, NULL, NULL, &aux, -1); }

int vgpu_track_move_bytes(int kind, uint64_t key, uint64_t from, uint64_t to) {
    uint64_t h = mix(kind, key);
    struct shard *s = shard_of(h);
    pthread_mutex_lock(&s->mu);
    struct node *n = *bucket_of(s, h);
    while (n != NULL && !(n->key == key && n->kind == kind)) n = n->next;
    int moved = n != NULL && n->bytes == from;
    if (moved) n->bytes = to;
    pthread_mutex_unlock(&s->mu);
    return moved;
}

/* The mappings, sorted by address. They never overlap: the driver maps only unmapped address
 * space, and a recorded mapping that meets a new one is taken first (vmm.c), so both their
 * starts and their ends are in order. A process maps what it has created (hundreds, thousands for
 * PyTorch's expandable segments): an array moved on insert costs less than a tree's nodes. */
struct mapping {
    uint64_t va, size, handle;
};
static pthread_mutex_t maps_mu = PTHREAD_MUTEX_INITIALIZER;
static struct mapping *maps;
static size_t nmaps, capmaps;

/* index of the first mapping that starts at va or later */
static size_t first_starting_from(uint64_t va) {
    size_t lo = 0, hi = nmaps;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (maps[mid].va < va)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* index of the first mapping that ends after va */
static size_t first_ending_after(uint64_t va) {
    size_t lo = 0, hi = nmaps;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (maps[mid].va + maps[mid].size <= va)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int vgpu_track_map_add(uint64_t va, uint64_t size, uint64_t handle) {
    int rc = 0;
    if (size == 0 || size > UINT64_MAX - va) return -1; /* no driver maps such a range */
    pthread_mutex_lock(&maps_mu);
    if (nmaps == capmaps) {
        size_t nc = capmaps ? capmaps * 2 : 64;
        struct mapping *nm = nc > SIZE_MAX / sizeof *nm ? NULL : realloc(maps, nc * sizeof *nm);
        if (nm == NULL) {
            rc = -1;
            goto out;
        }
        maps = nm;
        capmaps = nc;
    }
    size_t i = first_starting_from(va);
    memmove(&maps[i + 1], &maps[i], (nmaps - i) * sizeof *maps);
    maps[i] = (struct mapping){va, size, handle};
    nmaps++;
out:
    pthread_mutex_unlock(&maps_mu);
    return rc;
}

int vgpu_track_map_take(uint64_t va, uint64_t size, int whole, uint64_t *handle) {
    uint64_t end = size > UINT64_MAX - va ? UINT64_MAX : va + size;
    pthread_mutex_lock(&maps_mu);
    /* wholly inside: the first starting at va or later, if it ends by the range's end; meeting it:
     * the first ending after va, if it starts before the range's end */
    size_t i = whole ? first_starting_from(va) : first_ending_after(va);
    int found = i < nmaps && maps[i].va < end && (!whole || maps[i].size <= end - maps[i].va);
    if (found) {
        *handle = maps[i].handle;
        memmove(&maps[i], &maps[i + 1], (nmaps - i - 1) * sizeof *maps);
        nmaps--;
    }
    pthread_mutex_unlock(&maps_mu);
    return found;
}

void vgpu_track_reset(void) {
    /* fork child (single-threaded): the parent's entries are not ours; the shard mutexes may have
     * been held by parent threads at fork, so re-initialise them */
    for (int i = 0; i < SHARDS; i++) {
        pthread_mutex_init(&shards[i].mu, NULL);
        for (int b = 0; b < BUCKETS_PER_SHARD; b++) {
            struct node *n = shards[i].buckets[b];
            while (n) {
                struct node *next = n->next;
                free(n);
                n = next;
            }
            shards[i].buckets[b] = NULL;
        }
        while (shards[i].spare) {
            struct node *next = shards[i].spare->next;
            free(shards[i].spare);
            shards[i].spare = next;
        }
        shards[i].nspare = 0;
    }
    pthread_mutex_init(&maps_mu, NULL);
    free(maps);
    maps = NULL;
    nmaps = capmaps = 0;
}

/*
 * The process's own record of what it charged: (kind, key) -> (device index, bytes), so a free
 * returns exactly what its allocation took, to the device it took it from.
 * Sharded chained hash: allocations on different threads rarely contend on one shard lock.
 */
#include <pthread.h>
#include <stdlib.h>

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
        if (aux) *aux = n->aux;
        if (remove) {
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
    if (n != NULL && remove) free(n);
    return found;
}

int vgpu_track_take(int kind, uint64_t key, int *dev, uint64_t *bytes) {
    return lookup(kind, key, dev, bytes, NULL, 1);
}
int vgpu_track_take_aux(int kind, uint64_t key, int *dev, uint64_t *bytes, uint64_t *aux) {
    return lookup(kind, key, dev, bytes, aux, 1);
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
}

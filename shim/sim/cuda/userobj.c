/*
 * User objects (cuUserObjectCreate & co): a reference-counted pointer with a destructor, whose
 * references graphs can hold (cuGraphRetainUserObject); an executable graph holds what its graph
 * held when instantiated. The destructor runs when the last reference goes (here at once, on the
 * releasing thread; NVIDIA's driver runs it later on a thread of its own, which
 * CU_USER_OBJECT_NO_DESTRUCTOR_SYNC, the one flag allowed, lets a program not depend on).
 * cuda.core ties an executable graph's lifetime to its graph this way.
 */
#include "userobj.h"

#include "init.h"

#include <stdatomic.h>
#include <stdlib.h>

#define MAGIC_UOBJ 0x5c7c00ffu

struct CUuserObject_st {
    uint32_t magic, gen;
    _Atomic long refs;
    void *ptr;
    CUhostFn destroy;
};

struct sim_uref {
    struct CUuserObject_st *obj;
    unsigned count;
    struct sim_uref *next;
};

static pthread_mutex_t uref_mu = PTHREAD_MUTEX_INITIALIZER; /* guards every graph's and exec's list */

static void drop(struct CUuserObject_st *o, unsigned count) {
    if (atomic_fetch_sub(&o->refs, (long)count) == (long)count) {
        o->magic = MAGIC_DEAD; /* the struct is kept: a stale handle fails validation */
        if (o->destroy) o->destroy(o->ptr);
    }
}

SIM_EXPORT CUresult cuUserObjectCreate(CUuserObject *object_out, void *ptr, CUhostFn destroy,
                                       unsigned int initialRefcount, unsigned int flags) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!object_out || !destroy || initialRefcount == 0 || flags != CU_USER_OBJECT_NO_DESTRUCTOR_SYNC)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUuserObject_st *o = calloc(1, sizeof *o);
    if (!o) return CUDA_ERROR_OUT_OF_MEMORY;
    o->ptr = ptr;
    o->destroy = destroy;
    atomic_init(&o->refs, (long)initialRefcount);
    o->gen = sim_gen();
    o->magic = MAGIC_UOBJ;
    *object_out = o;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuUserObjectRetain(CUuserObject object, unsigned int count) {
    if (!SIM_VALID(object, MAGIC_UOBJ) || count == 0) return CUDA_ERROR_INVALID_VALUE;
    atomic_fetch_add(&object->refs, (long)count);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuUserObjectRelease(CUuserObject object, unsigned int count) {
    if (!SIM_VALID(object, MAGIC_UOBJ) || count == 0 || atomic_load(&object->refs) < (long)count)
        return CUDA_ERROR_INVALID_VALUE;
    drop(object, count);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphRetainUserObject(CUgraph graph, CUuserObject object, unsigned int count,
                                            unsigned int flags) {
    if (!SIM_VALID(graph, MAGIC_GRAPH) || !SIM_VALID(object, MAGIC_UOBJ) || count == 0 ||
        (flags & ~(unsigned)CU_GRAPH_USER_OBJECT_MOVE))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_uref *r = malloc(sizeof *r);
    if (!r) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!(flags & CU_GRAPH_USER_OBJECT_MOVE)) /* moved: the caller's references become the graph's */
        atomic_fetch_add(&object->refs, (long)count);
    pthread_mutex_lock(&uref_mu);
    *r = (struct sim_uref){.obj = object, .count = count, .next = graph->urefs};
    graph->urefs = r;
    pthread_mutex_unlock(&uref_mu);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphReleaseUserObject(CUgraph graph, CUuserObject object, unsigned int count) {
    if (!SIM_VALID(graph, MAGIC_GRAPH) || !SIM_VALID(object, MAGIC_UOBJ) || count == 0) return CUDA_ERROR_INVALID_VALUE;
    unsigned held = 0;
    pthread_mutex_lock(&uref_mu);
    for (struct sim_uref *r = graph->urefs; r; r = r->next)
        if (r->obj == object) held += r->count;
    if (held >= count) {
        unsigned left = count;
        for (struct sim_uref *r = graph->urefs; r && left; r = r->next)
            if (r->obj == object) {
                unsigned take = r->count < left ? r->count : left;
                r->count -= take;
                left -= take;
            }
    }
    pthread_mutex_unlock(&uref_mu);
    if (held < count) return CUDA_ERROR_INVALID_VALUE;
    drop(object, count);
    return CUDA_SUCCESS;
}

void sim_urefs_copy(const struct CUgraph_st *g, struct sim_uref **to) {
    pthread_mutex_lock(&uref_mu);
    for (struct sim_uref *r = g->urefs; r; r = r->next) {
        struct sim_uref *c = r->count ? malloc(sizeof *c) : NULL;
        if (!c) continue;
        atomic_fetch_add(&r->obj->refs, (long)r->count);
        *c = (struct sim_uref){.obj = r->obj, .count = r->count, .next = *to};
        *to = c;
    }
    pthread_mutex_unlock(&uref_mu);
}

void sim_urefs_release(struct sim_uref **list) {
    pthread_mutex_lock(&uref_mu);
    struct sim_uref *r = *list;
    *list = NULL;
    pthread_mutex_unlock(&uref_mu);
    while (r) {
        struct sim_uref *next = r->next;
        if (r->count) drop(r->obj, r->count);
        free(r);
        r = next;
    }
}

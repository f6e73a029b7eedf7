/*
 * Context-local storage: the private table c693336e-... (exporttab.c) through which NVIDIA's
 * runtime keeps its per-context state in the driver. Slots: 0 put(ctx, key, value, destructor),
 * 1 delete(ctx, key), 2 get(&value, ctx, key); a NULL context means the current one. A miss is
 * CUDA_ERROR_INVALID_HANDLE (the runtime then creates its state and puts it).
 *
 * When a context ends (cuCtxDestroy, the primary context released to zero or reset) each
 * entry's destructor runs with (ctx, key, value) while the context is still valid, outside the
 * driver's locks (a destructor may call back into the driver), so the runtime forgets its state
 * of a dead context.
 */
#include "ctxstore.h"

#include "ctxstack.h"
#include "init.h"

#include <stdlib.h>

struct sim_cls {
    void *key, *value;
    void (*dtor)(CUcontext, void *, void *);
    struct sim_cls *next;
};

static pthread_mutex_t cls_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult cls_ctx(CUcontext in, struct CUctx_st **out) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!in) return sim_get_ctx(out);
    if (!SIM_VALID(in, MAGIC_CTX)) return CUDA_ERROR_INVALID_CONTEXT;
    *out = in;
    return CUDA_SUCCESS;
}

static CUresult cls_put(CUcontext ctx, void *key, void *value, void (*dtor)(CUcontext, void *, void *)) {
    struct CUctx_st *c;
    CUresult rc = cls_ctx(ctx, &c);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&cls_lock);
    struct sim_cls *e;
    for (e = c->cls; e; e = e->next)
        if (e->key == key) break;
    if (!e) {
        e = calloc(1, sizeof *e);
        if (!e) {
            pthread_mutex_unlock(&cls_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        e->key = key;
        e->next = c->cls;
        c->cls = e;
    }
    e->value = value;
    e->dtor = dtor;
    pthread_mutex_unlock(&cls_lock);
    return CUDA_SUCCESS;
}

static CUresult cls_delete(CUcontext ctx, void *key) {
    struct CUctx_st *c;
    CUresult rc = cls_ctx(ctx, &c);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&cls_lock);
    rc = CUDA_ERROR_INVALID_HANDLE;
    for (struct sim_cls **p = &c->cls; *p; p = &(*p)->next) {
        if ((*p)->key == key) {
            struct sim_cls *e = *p;
            *p = e->next;
            free(e);
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&cls_lock);
    return rc;
}

static CUresult cls_get(void **value, CUcontext ctx, void *key) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = cls_ctx(ctx, &c);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&cls_lock);
    rc = CUDA_ERROR_INVALID_HANDLE;
    for (struct sim_cls *e = c->cls; e; e = e->next) {
        if (e->key == key) {
            *value = e->value;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&cls_lock);
    return rc;
}

void sim_ctxstore_end(struct CUctx_st *c) {
    pthread_mutex_lock(&cls_lock);
    struct sim_cls *list = c->cls;
    c->cls = NULL;
    pthread_mutex_unlock(&cls_lock);
    while (list) {
        struct sim_cls *e = list;
        list = e->next;
        if (e->dtor) e->dtor(c, e->key, e->value);
        free(e);
    }
}

static CUresult cls_slot3(void) { return CUDA_ERROR_NOT_SUPPORTED; }

static const void *const cls_table[4] = {
    (const void *)cls_put,
    (const void *)cls_delete,
    (const void *)cls_get,
    (const void *)cls_slot3,
};

const void *sim_ctxstore_table(void) { return cls_table; }

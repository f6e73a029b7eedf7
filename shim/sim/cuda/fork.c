/*
 * fork: a child starts with no CUDA state (init.c). The handlers run every part's fork steps in
 * one place, above them all: the free lists' and the process globals' locks are held across the
 * fork so that no thread that does not exist in the child holds them there; the child resets the
 * process globals, the calling thread's context stack, the primary contexts' flags and its node
 * slot.
 */
#include "context.h"
#include "ctxstack.h"
#include "init.h"
#include "stream.h"
#include "vmm.h"

#include "../common/state.h"

#include <pthread.h>

static void atfork_prepare(void) {
    pthread_mutex_lock(&G.lock);
    sim_stream_fork_prepare();
}

static void atfork_parent(void) {
    sim_stream_fork_parent();
    pthread_mutex_unlock(&G.lock);
}

static void atfork_child(void) {
    sim_stream_fork_child();
    sim_init_after_fork_child();
    sim_ctxstack_after_fork();
    sim_contexts_after_fork();
    sim_vmm_after_fork();
    if (sim_shm) sim_state_after_fork_child();
}

__attribute__((constructor)) static void sim_cuda_ctor(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

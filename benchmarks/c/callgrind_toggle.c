/* Switch callgrind's instrumentation on and off from inside a program (loaded with ctypes by
 * benchmarks/torch_small_kernels.py), so that a run started with --instr-atstart=no counts the
 * measured loop only: an interpreter's start-up (torch's import) is never instrumented. Outside
 * valgrind the client requests are no-ops. */
#include <valgrind/callgrind.h>

void cg_start(void) {
    CALLGRIND_ZERO_STATS;
    CALLGRIND_START_INSTRUMENTATION;
}

void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }

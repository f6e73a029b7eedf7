/*
 * Dies (SIGKILL) while holding the simulator's node-state lock, in the middle of an update:
 * it takes the robust mutex of $SIMGPU_STATE's state file, scribbles over the device 0 total
 * (as a process killed between two writes would leave it) and kills itself. The next process
 * to take the lock must recover (EOWNERDEAD) and rebuild the totals from the process slots.
 * With a first argument starting with 's' ("sched") it dies holding device 0's scheduler lock instead, leaving the
 * scheduler's state out of range (an owner that does not exist, a lane with more pending work
 * than it ever queued): the next locker must clamp it and go on. A second argument "stop" makes
 * it stop itself (SIGSTOP) holding the lock instead of dying: a holder that never returns.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../../shim/sim/common/sim_common.h"

int main(int argc, char **argv) {
    int sched = argc > 1 && argv[1][0] == 's';
    int stop = argc > 2 && argv[2][0] == 's';
    const char *dir = getenv("SIMGPU_STATE");
    if (!dir) return 2;
    char path[600];
    snprintf(path, sizeof path, "%s/state-v1-%zu", dir, sizeof(sim_shared));
    int fd = open(path, O_RDWR);
    if (fd < 0) {
        perror(path);
        return 3;
    }
    sim_shared *s = mmap(NULL, sizeof *s, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (s == MAP_FAILED) return 4;
    int rc = pthread_mutex_lock(sched ? &s->sched[0].lock : &s->lock);
    if (rc != 0 && rc != EOWNERDEAD) return 5;
    if (sched) { /* half-done updates */
        s->sched[0].run.owner = 100000;
        s->sched[0].lane[5].submitted = 1000;
        s->sched[0].run.pend[5] = 1ull << 60;
    } else {
        s->dev[0].used = 123456789;
    }
    printf("LOCKED\n");
    fflush(stdout);
    raise(stop ? SIGSTOP : SIGKILL);
    return stop ? 0 : 6;
}

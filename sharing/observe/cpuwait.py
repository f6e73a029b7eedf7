"""How long a process waited for a CPU: tells a share lost to a busy host from one the cap took.

A capped workload that is runnable but not running launches nothing, so on a loaded node it can
fall short of its cap through no fault of the cap. The kernel's schedstat counts that wait.
"""

from __future__ import annotations

import os

# A process that spent more than this percentage of its run runnable but waiting for a CPU was
# kept off it by a busy host: a share short of its cap then says nothing about the cap (a share
# above it still does). On a 2-core machine at load average 10 a spinning probe waits 5-8% of the
# time and gets its share; with three more CPU-bound processes about 80%, and falls a few points
# short.
STARVED_PERCENT = 25.0


def starved(cpu_wait_s: float, seconds: float) -> bool:
    """A process that waited `cpu_wait_s` for a CPU over a run of `seconds` was starved by its
    host (more than STARVED_PERCENT of the run); a run of no length is not judged starved."""
    return seconds > 0 and 100.0 * cpu_wait_s > STARVED_PERCENT * seconds


def thread_waits_ns(pid: int | str = "self") -> dict[str, int]:
    """Nanoseconds each thread of `pid` has spent runnable but waiting for a CPU, by thread id
    (/proc/PID/task/*/schedstat, second field); {} where the kernel does not keep it."""
    waits: dict[str, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return waits
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                waits[t] = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return waits


def cpu_wait_ns(pid: int | str = "self") -> int:
    """Nanoseconds the threads of `pid` have spent runnable but waiting for a CPU, together."""
    return sum(thread_waits_ns(pid).values())

"""How long a process waited for a CPU: tells a share lost to a busy host from one the cap took.

A capped workload that is runnable but not running launches nothing, so on a loaded node it can
fall short of its cap through no fault of the cap. The kernel's schedstat counts that wait.
"""

from __future__ import annotations

import os


def cpu_wait_ns(pid: int | str = "self") -> int:
    """Nanoseconds the threads of `pid` have spent runnable but waiting for a CPU
    (/proc/PID/task/*/schedstat, second field); 0 where the kernel does not keep it."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total

"""cpu_wait_ns counts time runnable but not running: two busy processes on one CPU each wait;
starved draws the line above which a short share is the host's doing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from sharing.observe.cpuwait import STARVED_PERCENT, cpu_wait_ns, starved, thread_waits_ns

BUSY = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\nprint('ok')"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="kernel without schedstat")
def test_two_busy_processes_on_one_cpu_wait_for_each_other() -> None:
    cpu = sorted(os.sched_getaffinity(0))[0]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUSY],
            stdout=subprocess.PIPE,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        )
        for _ in range(2)
    ]
    # Each needs 0.6 s of CPU on a CPU they share, so at least one of them waits for the other's
    # time; sampled while both still live (they print when done).
    waited = [0, 0]
    while all(p.poll() is None for p in procs):
        waited = [max(w, cpu_wait_ns(p.pid)) for w, p in zip(waited, procs, strict=True)]
        time.sleep(0.05)
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert out.strip() == b"ok"
    assert max(waited) > 100_000_000, waited  # > 0.1 s runnable, not running


def test_an_unknown_process_waited_nothing() -> None:
    assert cpu_wait_ns(2**22 + 7) == 0  # beyond pid_max's default: no such task
    assert thread_waits_ns(2**22 + 7) == {}


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="kernel without schedstat")
def test_each_thread_is_counted_once_and_the_total_is_their_sum() -> None:
    per_thread = thread_waits_ns()
    total = cpu_wait_ns()  # read after: waits only grow
    assert str(threading.get_native_id()) in per_thread, per_thread
    assert sum(per_thread.values()) <= total


def test_starved_is_more_than_the_threshold_of_the_run() -> None:
    at = STARVED_PERCENT / 100 * 8.0
    assert not starved(at, 8.0)
    assert starved(at + 0.01, 8.0)
    assert not starved(0.0, 8.0)
    assert not starved(1.0, 0.0)  # a run of no length says nothing

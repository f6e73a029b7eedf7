"""A process SIGKILLed at any instant must never wedge the others (robust node-state lock)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.sim.simhelp import EXACT_BYTES, EXACT_DURATIONS, Client, run_python, tool_info

pytestmark = [pytest.mark.slow, EXACT_BYTES]


GB = 10**9


def test_death_inside_the_state_lock_is_recovered(
    build_c: Callable[..., Path], sim_tool: Path, sim_env: dict[str, str]
) -> None:
    holder = Client(sim_tool, sim_env, "hold", str(10 * GB))
    try:
        die = build_c("sim_die_locked.c")
        r = subprocess.run([str(die)], env=sim_env, capture_output=True, text=True, timeout=30)
        assert r.returncode == -signal.SIGKILL and "LOCKED" in r.stdout, r.stdout + r.stderr
        # the next locker recovers and recomputes the device total from the live slots
        free, total = tool_info(sim_tool, sim_env)  # would hang (and time out) without recovery
        assert free == total - 10 * GB
        used = run_python(
            sim_env,
            """
nv.nvmlInit()
print(json.dumps(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(0)).used))
""",
        )
        assert used == 10 * GB
    finally:
        assert holder.finish() == 0
    assert tool_info(sim_tool, sim_env)[0] == 80 << 30


def test_many_processes_killed_while_working(sim_tool: Path, sim_env: dict[str, str]) -> None:
    """Kill launch loops and holders at arbitrary moments; the node stays usable and clean."""
    victims = []
    for i in range(6):
        args = ("hold", str(GB)) if i % 2 else ("load", "100", "5", "5", "30")
        victims.append(Client(sim_tool, sim_env, *args))
    for v in victims:
        v.kill()
    free, total = tool_info(sim_tool, sim_env)
    assert free == total
    procs = run_python(
        sim_env,
        """
nv.nvmlInit()
print(json.dumps(len(nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(0)))))
""",
    )
    assert procs == 0


def test_random_kills_during_lock_heavy_loops(sim_tool: Path, sim_env: dict[str, str]) -> None:
    """Processes in tight allocate/free loops (each call takes the node lock) are SIGKILLed at
    random instants, round after round: nobody wedges and the books balance afterwards."""
    import random
    import time

    rng = random.Random(7)
    for _ in range(6):
        procs = [
            subprocess.Popen(
                [str(sim_tool), "allocs", "100000000"],
                env=sim_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for _ in range(3)
        ]
        time.sleep(rng.uniform(0.05, 0.3))
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(10)
        free, total = tool_info(sim_tool, sim_env)  # times out if a dead owner wedged the lock
        assert free == total


def test_death_inside_the_scheduler_lock_is_recovered(
    build_c: Callable[..., Path], sim_tool: Path, sim_env: dict[str, str]
) -> None:
    """Killed holding device 0's scheduler lock with its state half-written: the next launch
    recovers (no hang), clamps the state (a lane cannot have more pending than it queued) and
    kernels take exactly their time again."""
    tool_info(sim_tool, sim_env)  # creates the node state
    die = build_c("sim_die_locked.c")
    r = subprocess.run([str(die), "sched"], env=sim_env, capture_output=True, text=True, timeout=30)
    assert r.returncode == -signal.SIGKILL and "LOCKED" in r.stdout, r.stdout + r.stderr
    timing = build_c("sim_timing.c")
    env = dict(sim_env, **EXACT_DURATIONS)
    out = subprocess.run(
        [str(timing), "durations", "sim_100us", "20"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,  # a wedged lock or a lane with 2^60 ns pending would hang here
    )
    assert out.returncode == 0, out.stderr
    assert [float(x) for x in out.stdout.split()] == [100.0] * 20


@pytest.mark.parametrize(
    "lock", ["node", "sched"]
)  # sim_die_locked: the node state lock, or a scheduler
def test_a_stopped_lock_holder_does_not_hang_the_others_of_its_state(
    build_c: Callable[..., Path], sim_tool: Path, sim_env: dict[str, str], lock: str
) -> None:
    """A process of the same state stopped (SIGSTOP) holding the state lock or device 0's
    scheduler lock: the others wait SIMGPU_LOCK_TIMEOUT_MS once, say so on stderr, and go on
    (memory queries, allocations, launches and synchronisation)."""
    import time

    env = dict(sim_env, SIMGPU_LOCK_TIMEOUT_MS="500", **EXACT_DURATIONS)
    tool_info(sim_tool, env)  # creates the node state
    holder = subprocess.Popen([str(build_c("sim_die_locked.c")), lock, "stop"], env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "LOCKED"
        t0 = time.monotonic()
        free, total = tool_info(sim_tool, env)  # would hang for ever on the stopped holder
        assert free == total
        r = subprocess.run([str(sim_tool), "alloc", str(GB)], env=env, capture_output=True,
                           text=True, timeout=30)  # fmt: skip
        assert r.returncode == 0, r.stderr
        timing = build_c("sim_timing.c")
        out = subprocess.run([str(timing), "durations", "sim_100us", "5"], env=env,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert [float(x) for x in out.stdout.split()] == [100.0] * 5
        assert "its holder does not release it" in out.stderr + r.stderr
        assert time.monotonic() - t0 < 20
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)


@pytest.mark.parametrize("garbage", ["random", "owner"])
def test_garbage_in_the_state_lock_word_is_not_waited_on(
    sim_tool: Path, sim_env: dict[str, str], garbage: str
) -> None:
    """A process of the state overwrote the lock: with random bytes (kind word included: the
    next locker initialises it again), or with the lock word of a holder that does not exist
    (glibc's layout: the kind intact, so it looks held for ever; the next locker waits
    SIMGPU_LOCK_TIMEOUT_MS once and goes on). Either way no one blocks for ever or crashes."""
    import os
    import struct

    env = dict(sim_env, SIMGPU_LOCK_TIMEOUT_MS="500")
    tool_info(sim_tool, env)
    [state] = [p for p in Path(env["SIMGPU_STATE"]).iterdir() if "." not in p.name]
    with state.open("r+b") as f:
        f.seek(16)  # the lock, after the magic and the size
        if garbage == "random":
            f.write(os.urandom(40))
        else:  # __lock and __owner (glibc x86-64 and aarch64): a TID no thread has
            f.write(struct.pack("<iIi", 0x3FFFFFF0, 0, 0x3FFFFFF0))
    free, total = tool_info(sim_tool, env)
    assert free == total

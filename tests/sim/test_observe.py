"""SIMGPU_OBSERVE: an observer (NVML) sees the processes, memory and busy time of other state
directories read-only, as a kernel driver sees every context, and nothing a writer of those
states does can fault it, hang it or make it name another process (docs/simulator.md,
"Observing other states").

Each state directory below stands for one tenant's (a claim's, on a plugin's --sim node); the
observer is a separate process with a state of its own (the plugin's). The attacks are a
tenant's on its own state: truncate the file, fill it with garbage (random bytes; a valid header
with every slot claimed, forged PIDs and sizes, the slot locks held), and a process of that
state stopped (SIGSTOP) while it holds the state's lock or a device's scheduler lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.sim.simhelp import EXACT_BYTES, Client, run_python

pytestmark = [pytest.mark.slow, EXACT_BYTES]

GB = 10**9
TOTAL = 80 << 30  # the default H100's memory
SLOT_LOCK_BASE = 1 << 30  # shim/sim/common/state.h: the slots' OFD lock bytes
F_OFD_SETLK = 37  # <fcntl.h> on Linux (Python's fcntl has no name for it before 3.13)

VIEW = """
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
t0 = time.monotonic()
procs = sorted([p.pid, p.usedGpuMemory] for p in nv.nvmlDeviceGetComputeRunningProcesses(h))
mem = nv.nvmlDeviceGetMemoryInfo(h)
util = nv.nvmlDeviceGetUtilizationRates(h).gpu
try:
    samples = sorted([s.pid, s.smUtil] for s in nv.nvmlDeviceGetProcessUtilization(h, 0))
except nv.NVMLError_NotFound:
    samples = []
print(json.dumps({"procs": procs, "used": mem.used, "total": mem.total, "util": util,
                  "samples": samples, "seconds": time.monotonic() - t0}))
"""


def state_file(d: Path) -> Path:
    [f] = [p for p in d.iterdir() if p.name.startswith("state-v1-") and "." not in p.name]
    return f


@pytest.fixture
def tenants(tmp_path: Path, sim_env: dict[str, str]) -> Iterator[tuple[Path, dict[str, str]]]:
    """The observed root with two tenants' state directories, a and b (sticky, world-writable,
    as a plugin lays them out); yields (root, the environment of tenant `name`'s processes
    as env_of(name)) through the `observer` env: SIMGPU_OBSERVE set, its own state."""
    root = tmp_path / "observed"
    root.mkdir()
    for name in ("a", "b"):
        (root / name).mkdir()
        os.chmod(root / name, 0o1777)
    yield root, sim_env


def env_of(sim_env: dict[str, str], root: Path, name: str) -> dict[str, str]:
    return dict(sim_env, SIMGPU_STATE=str(root / name))


def observer_env(sim_env: dict[str, str], root: Path) -> dict[str, str]:
    return dict(sim_env, SIMGPU_OBSERVE=str(root))  # its own SIMGPU_STATE: sim_env's


def view(sim_env: dict[str, str], root: Path) -> dict[str, object]:
    out = run_python(observer_env(sim_env, root), VIEW, timeout=20)
    assert isinstance(out, dict)
    return out


def test_the_observer_sees_every_state_and_each_tenant_only_its_own(
    sim_tool: Path, tenants: tuple[Path, dict[str, str]]
) -> None:
    root, sim_env = tenants
    a = Client(sim_tool, env_of(sim_env, root, "a"), "hold", str(3 * GB))
    b = Client(sim_tool, env_of(sim_env, root, "b"), "load", "1000", "50", "100", "6")
    try:
        time.sleep(2.5)  # b's load fills a sample period
        v = view(sim_env, root)
        pids = [p for p, _ in v["procs"]]  # type: ignore[attr-defined]
        assert sorted(pids) == sorted([a.pid, b.pid]), v
        assert [u for p, u in v["procs"] if p == a.pid] == [3 * GB], v  # type: ignore[attr-defined]
        assert v["used"] == 3 * GB and v["total"] == TOTAL, v
        # b's 50 % duty cycle on its own timeline (wide bounds: a busy machine delays launches)
        assert 20 <= v["util"] <= 70, v  # type: ignore[operator]
        samples = dict(v["samples"])  # type: ignore[call-overload]
        assert samples.get(a.pid) == 0 and 20 <= samples.get(b.pid, -1) <= 70, v
        # A tenant's own NVML sees its own state only (its claim's processes).
        own = run_python(env_of(sim_env, root, "a"), VIEW, timeout=20)
        assert [p for p, _ in own["procs"]] == [a.pid], own
    finally:
        assert a.finish() == 0
        b.finish(60)
    after = view(sim_env, root)
    assert after["procs"] == [] and after["used"] == 0, after


def _hold_slot_locks(path: Path) -> int:
    """Hold every slot's liveness lock of a state file, as an attacker of that state can: every
    slot then looks alive."""
    fd = os.open(path, os.O_RDWR)
    for slot in range(128):
        lock = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, SLOT_LOCK_BASE + slot, 1, 0)
        with contextlib.suppress(BlockingIOError):  # the slot of a's own process
            fcntl.fcntl(fd, F_OFD_SETLK, lock)
    return fd


@pytest.mark.parametrize("attack", ["truncate", "shrink", "random", "forged"])
def test_a_wrecked_state_never_faults_or_fools_the_observer(
    build_c: Callable[..., Path], sim_tool: Path, tenants: tuple[Path, dict[str, str]], attack: str
) -> None:
    """Tenant a wrecks its own state while its process holds memory; tenant b's process keeps
    running, the observer answers at once, and what it reports of a's state is at worst empty
    or a's own process: never a fault, never more than the device, never b's PID."""
    root, sim_env = tenants
    a = Client(sim_tool, env_of(sim_env, root, "a"), "hold", str(GB))
    b = Client(sim_tool, env_of(sim_env, root, "b"), "hold", str(2 * GB))
    held = -1
    try:
        f = state_file(root / "a")
        size = f.stat().st_size
        if attack == "truncate":
            os.truncate(f, 0)
        elif attack == "shrink":
            os.truncate(f, size // 2)
        elif attack == "random":
            with f.open("r+b") as w:
                for off in range(0, 4 << 20, 1 << 20):
                    w.seek(off)
                    w.write(os.urandom(1 << 20))
        else:  # a valid header, every slot claimed with b's PID and huge sizes, locks held
            out = subprocess.run([str(build_c("sim_layout.c"))], capture_output=True, text=True,
                                 check=True).stdout  # fmt: skip
            layout = {k: int(v) for k, v in (kv.split("=") for kv in out.split())}
            slot = struct.pack("<iI", b.pid, 7) + struct.pack("<Q", 1 << 62) * 128
            slot += struct.pack("<I", 1) * 128
            assert len(slot) == layout["slot"]
            with f.open("r+b") as w:
                w.seek(16)  # past the magic and size: the lock and everything after, garbage
                w.write(os.urandom(layout["proc"] - 16))
                w.seek(layout["active"])
                w.write(b"\xff" * 16)
                w.seek(layout["proc"])
                w.write(slot * 128)
            held = _hold_slot_locks(f)
        v = view(sim_env, root)
        assert v["seconds"] < 5, v  # type: ignore[operator]
        # b is listed once, with its own memory (a's forged slots name b's PID)
        assert [u for p, u in v["procs"] if p == b.pid] == [2 * GB], v  # type: ignore[attr-defined]
        assert {p for p, _ in v["procs"]} <= {a.pid, b.pid}, v  # type: ignore[attr-defined]
        assert 2 * GB <= v["used"] <= TOTAL, v  # type: ignore[operator]
        # b's process is alive and its GPU keeps working
        assert b.proc.poll() is None
        more = subprocess.run([str(sim_tool), "alloc", str(GB)], env=env_of(sim_env, root, "b"),
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert more.returncode == 0, more.stderr
    finally:
        if held >= 0:
            os.close(held)
        a.kill()
        assert b.finish() == 0


@pytest.mark.parametrize(
    "lock", ["node", "sched"]
)  # sim_die_locked: the node state lock, or a scheduler
def test_a_stopped_lock_holder_does_not_hang_the_observer_or_other_states(
    build_c: Callable[..., Path],
    sim_tool: Path,
    tenants: tuple[Path, dict[str, str]],
    lock: str,
) -> None:
    root, sim_env = tenants
    a_env = env_of(sim_env, root, "a")
    a = Client(sim_tool, a_env, "hold", str(GB))
    b = Client(sim_tool, env_of(sim_env, root, "b"), "hold", str(2 * GB))
    holder = subprocess.Popen([str(build_c("sim_die_locked.c")), lock, "stop"], env=a_env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "LOCKED"
        deadline = time.monotonic() + 10
        while Path(f"/proc/{holder.pid}/stat").read_text().split(") ")[1][0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        v = view(sim_env, root)
        assert v["seconds"] < 5, v  # type: ignore[operator]
        assert dict(v["procs"]).get(b.pid) == 2 * GB, v  # type: ignore[call-overload]
        load = subprocess.run([str(sim_tool), "load", "100", "10", "10", "1"],
                              env=env_of(sim_env, root, "b"), capture_output=True, text=True,
                              timeout=30)  # fmt: skip
        assert load.returncode == 0, load.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        a.kill()
        assert b.finish() == 0


def test_a_pattern_names_a_directory_in_each_subdirectory(
    sim_tool: Path, tmp_path: Path, sim_env: dict[str, str]
) -> None:
    """SIMGPU_OBSERVE=DIR/*/NAME (a plugin's claims/*/sim); a link in place of NAME, or of a
    subdirectory, is not followed."""
    claims = tmp_path / "claims"
    for name in ("c1", "c2", "c3"):
        (claims / name / "sim").mkdir(parents=True)
    os.symlink(claims / "c1" / "sim", claims / "c3" / "sim-link")
    os.symlink(claims / "c1", claims / "c4")
    holders = [Client(sim_tool, dict(sim_env, SIMGPU_STATE=str(claims / c / "sim")), "hold", str(GB))
               for c in ("c1", "c2")]  # fmt: skip
    try:
        env = dict(sim_env, SIMGPU_OBSERVE=f"{claims}/*/sim")
        v = run_python(env, VIEW, timeout=20)
        assert sorted(p for p, _ in v["procs"]) == sorted(h.pid for h in holders), v
        assert v["used"] == 2 * GB, v  # c1 counted once (c4, a link to it, is not followed)
        bad = run_python(dict(sim_env, SIMGPU_OBSERVE=f"{claims}/*/a/b"), VIEW, timeout=20)
        assert bad["procs"] == [] and bad["used"] == 0, bad
    finally:
        for h in holders:
            assert h.finish() == 0


def test_users_of_a_shared_state_directory_share_one_state(
    sim_tool: Path, sim_env: dict[str, str]
) -> None:
    """A state directory every user may write (sticky, 1777 root: a plugin's claim directory,
    whose processes may run as any user): the files its first process creates are 0666, so a
    process of another user shares the state (before, they were 0600 and its cuInit failed)."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        os.chmod(base, 0o755)
        shared = base / "claim"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        tool = base / "sim_tool"
        shutil.copy2(sim_tool, tool)
        env = dict(sim_env, SIMGPU_STATE=str(shared))

        def as_user(uid: int) -> list[str]:
            return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", str(tool)]

        first = subprocess.Popen([*as_user(65534), "hold", str(GB)], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)  # fmt: skip
        try:
            assert first.stdout is not None and first.stdout.readline().startswith("READY")
            assert {f.stat().st_mode & 0o777 for f in shared.iterdir()} == {0o666}
            other = subprocess.run([*as_user(65533), "info"], env=env, capture_output=True,
                                   text=True, timeout=30)  # fmt: skip
            assert other.returncode == 0, other.stderr
            assert f"free={TOTAL - GB} " in other.stdout + " ", other.stdout
        finally:
            if first.stdin:
                first.stdin.close()
            first.wait(30)
    finally:
        shutil.rmtree(base, ignore_errors=True)

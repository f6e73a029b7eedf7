"""A process of the slice that writes garbage into the accounting file's lock must not
hang the others: every locker waits a bounded time, then rebuilds the mutex and the totals from
the live slots (one log line). Real processes: the shim's region code in the harness, and CUDA
programs under the preloaded shim, allocate while the test scribbles over the lock."""

from __future__ import annotations

import os
import struct
import subprocess
import time
from pathlib import Path

from sharing._region_cffi import ffi, lib

from sharing import region
from tests.shim.conftest import parse_ops

MiB = 1 << 20
LOCK_OFFSET: int = ffi.offsetof("struct vgpu_region", "lock")
LOCK_SIZE: int = 8 * lib.VGPU_LOCK_WORDS


def garbage_patterns(current: bytes) -> list[bytes]:
    """Random bytes, all ones, and the worst for a waiter: the mutex intact but its lock word
    naming an owner that does not exist (no thread will ever release or die holding it)."""
    fake_owner = struct.pack("<I", 0x3FFFFFFE) + current[4:]
    return [fake_owner, os.urandom(LOCK_SIZE), b"\xff" * LOCK_SIZE, fake_owner]


def scribble(path: Path, pattern: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, pattern, LOCK_OFFSET)
    finally:
        os.close(fd)


class Workers:
    """Processes allocating on the slice without a pause: each one that ends is checked and
    replaced, so the lock is in use whenever the test writes over it."""

    def __init__(self, commands: list[tuple[list[str], dict[str, str] | None]]) -> None:
        self.commands = commands
        self.procs = [self._start(i) for i in range(len(commands))]
        self.finished: list[tuple[int, str, str, int]] = []  # (which command, stdout, stderr, rc)

    def _start(self, i: int) -> subprocess.Popen[str]:
        argv, env = self.commands[i]
        return subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    self._collect(i, p, 1)
                    self.procs[i] = self._start(i)
            time.sleep(0.02)

    def _collect(self, i: int, p: subprocess.Popen[str], timeout: float) -> None:
        out, err = p.communicate(timeout=timeout)
        self.finished.append((i, out, err, p.returncode))

    def finish(self, timeout: float) -> None:
        """Every process must end by itself within timeout (none hangs on the lock)."""
        try:
            for i, p in enumerate(self.procs):
                self._collect(i, p, timeout)
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()


def test_garbage_in_the_lock_word_does_not_hang_the_slice(
    shim_harness: Path, shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "slice.region"
    limit = 256 * MiB
    region.create(path)
    env = dict(
        shim_env,
        CUDA_DEVICE_MEMORY_LIMIT=str(limit),
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(path),
    )
    harness = [str(shim_harness), "stress", str(path), "0", str(limit), "2", "20000"]
    cuda = [str(shim_ops), "init", "ctx", f"stress:2:5000:{16 * MiB}"]
    workers = Workers([(harness, None), (harness, None), (cuda, env), (cuda, env)])
    workers.run_for(0.5)
    with path.open("rb") as f:
        f.seek(LOCK_OFFSET)
        current = f.read(LOCK_SIZE)
    for pattern in garbage_patterns(current):
        scribble(path, pattern)
        workers.run_for(1.0)
    workers.finish(timeout=60)
    for i, out, err, rc in workers.finished:
        assert rc == 0, (out, err)
        if i < 2:
            assert out.strip() == "done failed=0", (out, err)
        else:
            stress = parse_ops(out)[-1]
            assert stress["op"] == "stress" and stress["rc"] == "0", (out, err)
            assert int(stress["ok"]) > 0 and stress["other"] == "0", (out, err)
    assert {i for i, *_ in workers.finished} == {0, 1, 2, 3}
    logs = "".join(err for _, _, err, _ in workers.finished)
    assert "vgpu: accounting lock was unusable" in logs, logs
    # the books balance: everything was returned, and the lock works again for a newcomer
    # (the last scribble may still be there: the newcomer rebuilds it)
    scribble(path, garbage_patterns(current)[0])
    used = subprocess.run(
        [str(shim_harness), "used", str(path), "0"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert used.stdout.strip() == "0"
    snap = region.read(path)
    assert snap.devices[0].used == 0 == snap.used_by_live(0)
    assert snap.lock_recoveries >= 2  # one during the run (the log says so), the newcomer's

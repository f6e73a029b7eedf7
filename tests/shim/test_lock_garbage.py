"""A process of the slice that writes garbage into the accounting file's lock must not
hang the others: every locker waits a bounded time, then takes the lock over and recomputes the
totals from the live slots (one log line). Real processes: the shim's region code in the harness, and CUDA
programs under the preloaded shim, allocate while the test scribbles over the lock."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from sharing._region_cffi import ffi

from sharing import region
from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support.lock_garbage import (
    DEAD_SLOT,
    garbage_patterns,
    hold_hung_slot,
    scribble,
    token,
)
from tests.support.shim_ops import parse_ops

pytestmark = [NO_CONTEXT_MEMORY, pytest.mark.slow]


MiB = 1 << 20


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
    hung = hold_hung_slot(path)
    try:
        workers.run_for(0.5)
        for pattern in garbage_patterns():
            scribble(path, pattern)
            workers.run_for(1.0)
        workers.finish(timeout=60)
    finally:
        os.close(hung)
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
    assert "vgpu: accounting lock held for more than 2 s" in logs, logs
    assert "vgpu: accounting lock held garbage" in logs, logs
    # the books balance: everything was returned, and the lock works again for a newcomer
    # (a dead holder's word left there: the newcomer takes it over)
    scribble(path, token(DEAD_SLOT, 13))
    used = subprocess.run(
        [str(shim_harness), "used", str(path), "0"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert used.stdout.strip() == "0"
    snap = region.read(path)
    assert snap.devices[0].used == 0 == snap.used_by_live(0)
    assert snap.lock_recoveries >= 2  # one during the run (the log says so), the newcomer's


def test_a_stale_total_left_by_an_overlapped_critical_section_does_not_refuse_for_ever(
    shim_harness: Path, tmp_path: Path
) -> None:
    """A holder taken over (hung, or garbage in the word) may still finish its critical section
    and store a total computed before the takeover's recount: the total then says more than the
    live slots hold. The next allocation the slots leave room for must be granted (and the total
    set right), not refused until some later takeover."""
    path = tmp_path / "slice.region"
    region.create(path)
    holder = subprocess.Popen(
        [str(shim_harness), "hold", str(path), "0", str(64 * MiB)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        # what the overlapped section stores: its stale total plus its own charge
        used_at = ffi.offsetof("struct vgpu_region", "devices") + ffi.offsetof(
            "struct vgpu_device_account", "used"
        )
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, (256 * MiB).to_bytes(8, "little"), used_at)
        finally:
            os.close(fd)
        assert region.read(path).devices[0].used == 256 * MiB
        charge = subprocess.run(
            [str(shim_harness), "charge", str(path), "0", str(64 * MiB), str(256 * MiB)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert charge.stdout.strip() == f"granted total={128 * MiB}", (charge.stdout, charge.stderr)
        # and a charge that does not fit what the live slots hold is still refused
        over = subprocess.run(
            [str(shim_harness), "charge", str(path), "0", str(200 * MiB), str(256 * MiB)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert over.returncode == 5 and over.stdout.strip() == f"refused total={64 * MiB}", over
    finally:
        holder.kill()
        holder.wait()

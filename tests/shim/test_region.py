"""The accounting region on its own (no driver): layout, atomic creation, crash-safety."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sharing import region


def test_create_then_read(tmp_path: Path) -> None:
    p = tmp_path / "slice.region"
    assert region.create(p) is True
    assert region.create(p) is False  # existing file left as is
    snap = region.read(p)
    assert snap.layout_version == region.LAYOUT_VERSION
    assert all(d.used == 0 for d in snap.devices)
    assert snap.processes == ()
    assert os.stat(p).st_size == region.FILE_SIZE
    assert not list(tmp_path.glob("*.tmp.*"))  # the temporary file is gone


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "size 0 bytes"),
        (b"x" * 100, "size 100 bytes"),
        (b"\0" * region.FILE_SIZE, "wrong magic"),
    ],
)
def test_corrupt_files_are_refused_with_one_line(
    tmp_path: Path, content: bytes, message: str
) -> None:
    p = tmp_path / "bad.region"
    p.write_bytes(content)
    with pytest.raises(region.RegionError, match=message) as e:
        region.read(p)
    assert "\n" not in str(e.value)


def test_wrong_layout_version_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "old.region"
    region.create(p)
    data = bytearray(p.read_bytes())
    data[4:8] = (1).to_bytes(4, "little")  # header.layout_version
    p.write_bytes(bytes(data))
    with pytest.raises(region.RegionError, match="layout version 1"):
        region.read(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(region.RegionError, match="does not exist"):
        region.read(tmp_path / "nope")


def test_stress_many_processes_never_exceed_the_limit(shim_harness: Path, tmp_path: Path) -> None:
    """4 processes x 8 threads charge and return at random against one limit."""
    p = str(tmp_path / "stress.region")
    limit = 64 << 20
    procs = [
        subprocess.Popen(
            [str(shim_harness), "stress", p, "0", str(limit), "8", "20000"], stdout=subprocess.PIPE
        )
        for _ in range(4)
    ]
    for pr in procs:
        out, _ = pr.communicate(timeout=120)
        assert pr.returncode == 0, out
    snap = region.read(p)
    assert snap.devices[0].used == 0
    assert 0 < snap.devices[0].peak <= limit
    assert snap.devices[0].denials > 0  # the limit was actually reached


def test_sigkilled_holder_is_reclaimed(shim_harness: Path, tmp_path: Path) -> None:
    p = str(tmp_path / "kill.region")
    holder = subprocess.Popen(
        [str(shim_harness), "hold", p, "2", "12345"], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "held"
    snap = region.read(p)
    assert snap.devices[2].used == 12345
    assert [pr.alive for pr in snap.processes] == [True]
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    snap = region.read(p)
    assert [pr.alive for pr in snap.processes] == [False]  # seen dead, not yet reclaimed
    out = subprocess.run(
        [str(shim_harness), "used", p, "2"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "0"
    assert region.read(p).reclaimed_slots == 1


def test_holder_killed_inside_the_lock_does_not_block_others(
    shim_harness: Path, tmp_path: Path
) -> None:
    p = str(tmp_path / "lock.region")
    r = subprocess.run([str(shim_harness), "lockdie", p], timeout=10, check=False)
    assert r.returncode == -signal.SIGKILL
    # Not blocked: the next locker finishes (60 s only bounds a hang) by recovering the lock.
    out = subprocess.run(
        [str(shim_harness), "used", p, "0"], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "0"  # the half-done update was discarded, the charge reclaimed
    assert region.read(p).lock_recoveries == 1


def test_sigkill_loop_while_others_charge(shim_harness: Path, tmp_path: Path) -> None:
    """Processes killed at random instants (inside critical sections too) never block the rest."""
    p = str(tmp_path / "loop.region")
    limit = 1 << 30
    survivors = [
        subprocess.Popen(
            [str(shim_harness), "stress", p, "0", str(limit), "2", "30000"], stdout=subprocess.PIPE
        )
        for _ in range(2)
    ]
    for i in range(30):
        victim = subprocess.Popen(
            [str(shim_harness), "stress", p, "0", str(limit), "4", "10000000"],
            stdout=subprocess.DEVNULL,
        )
        time.sleep(0.01 + (i % 5) * 0.005)
        victim.kill()
        victim.wait(timeout=10)
    for s in survivors:
        s.communicate(timeout=120)
        assert s.returncode == 0
    out = subprocess.run(
        [str(shim_harness), "used", p, "0"], capture_output=True, text=True, timeout=10, check=True
    )
    assert out.stdout.strip() == "0"

"""Garbage in the accounting file's lock: the byte patterns a misbehaving process of the slice
could leave in the lock word, writing them there, and a slot whose holder never returns."""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

from sharing._region_cffi import ffi, lib

LOCK_OFFSET: int = ffi.offsetof("struct vgpu_region", "lock")
LOCK_SIZE: int = 8 * lib.VGPU_LOCK_WORDS

HUNG_SLOT = 1000  # a slot the test keeps alive (holds its byte lock): its "holder" never returns
DEAD_SLOT = 900  # a slot nobody holds: its holder died


def token(slot: int, seq: int) -> bytes:
    """A lock word as a holder of `slot` writes it (shim/src/region.c: slot + 1, sequence)."""
    return struct.pack("<I", (slot + 1) | (seq << 11)) + os.urandom(LOCK_SIZE - 4)


def garbage_patterns() -> list[bytes]:
    """A live process that took the lock and stopped (the worst for a waiter: only the timeout
    tells), a dead holder, random bytes, all ones."""
    return [
        token(HUNG_SLOT, 7),
        os.urandom(LOCK_SIZE),
        token(DEAD_SLOT, 9),
        b"\xff" * LOCK_SIZE,
        token(HUNG_SLOT, 11),
    ]


def hold_hung_slot(path: Path) -> int:
    """Keep HUNG_SLOT's byte locked as its owner would (an open-file-description lock: unlike a
    POSIX lock, it survives our closing other descriptors of the file): the slot looks alive.
    Returns the descriptor; closing it drops the lock."""
    fd = os.open(path, os.O_RDWR)
    flock = struct.pack(
        "hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, lib.VGPU_SLOT_LOCK_BASE + HUNG_SLOT, 1, 0
    )
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, flock)
    return fd


def scribble(path: Path, pattern: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, pattern, LOCK_OFFSET)
    finally:
        os.close(fd)

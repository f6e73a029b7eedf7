"""Durable file replacement shared by every writer of state files (CDI specs, the plugin's
checkpoint, a claim's limits file, the staged driver files): a reader sees the old file or the
new one, whole, never a part, and a crash after the call cannot undo the rename."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically and durably (temp file, fsync, rename, fsync dir).

    Nothing follows a link: the temporary file is created with O_CREAT|O_EXCL|O_NOFOLLOW relative
    to the directory's descriptor (only that new file is fchmod'ed), and the rename replaces
    whatever has the final name, a planted link included, without touching the link's target.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            tmp = f".{path.name}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
                break
            except FileExistsError:
                continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)

"""Atomic writing and removal of CDI spec files in a spec directory (e.g. /var/run/cdi).

A runtime may read the directory at any moment: a spec must appear whole or not at all, so it is
written to a temporary file in the same directory, fsynced, renamed over the final name, and the
directory fsynced so the rename survives a crash. Temporary names start with '.' and do not end
in '.json', so CDI consumers (which load only *.json and *.yaml) never pick them up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
from pathlib import Path

from cdi.schema import validate
from cdi.spec import Spec, transient_spec_name

log = logging.getLogger(__name__)


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


class SpecWriter:
    """Writes and removes per-claim transient specs in one CDI spec directory."""

    def __init__(self, cdi_root: Path) -> None:
        self.cdi_root = cdi_root

    def path_for(self, kind: str, uid: str) -> Path:
        return self.cdi_root / transient_spec_name(kind, uid)

    def write(self, spec: Spec, uid: str) -> Path:
        """Check, validate against the schema, and atomically write the spec for claim `uid`."""
        spec.check()
        doc = spec.to_dict()
        validate(doc)
        path = self.path_for(spec.kind, uid)
        atomic_write(path, (json.dumps(doc, indent=2) + "\n").encode())
        log.debug("wrote CDI spec %s (cdiVersion %s)", path, doc["cdiVersion"])
        return path

    def remove(self, kind: str, uid: str) -> bool:
        """Remove the spec for claim `uid`; True if it existed. Idempotent."""
        path = self.path_for(kind, uid)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        fsync_dir(path.parent)
        log.debug("removed CDI spec %s", path)
        return True

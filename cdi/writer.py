"""Atomic writing and removal of CDI spec files in a spec directory (e.g. /var/run/cdi).

A runtime may read the directory at any moment: a spec must appear whole or not at all, so it is
written to a temporary file in the same directory, fsynced, renamed over the final name, and the
directory fsynced so the rename survives a crash. Temporary names start with '.' and do not end
in '.json', so CDI consumers (which load only *.json and *.yaml) never pick them up.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from cdi.schema import validate
from cdi.spec import Spec, transient_spec_name

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically and durably (temp file, fsync, rename, fsync dir)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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

"""Atomic writing and removal of CDI spec files in a spec directory (e.g. /var/run/cdi).

A runtime may read the directory at any moment: a spec must appear whole or not at all, so it is
written with sharing.fsutil.atomic_write (temporary file, fsync, rename, fsync of the directory).
Temporary names start with '.' and do not end in '.json', so CDI consumers (which load only
*.json and *.yaml) never pick them up.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from cdi.schema import validate
from cdi.spec import Spec, transient_spec_name, transient_spec_prefix
from sharing.fsutil import atomic_write, fsync_dir

log = logging.getLogger(__name__)


def is_write_leftover(kind: str, name: str) -> bool:
    """Whether `name` is a temporary file of a write of a spec of `kind` a crash cut short."""
    return name.startswith(f".{transient_spec_prefix(kind)}") and name.endswith(".tmp")


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
        """Remove the spec for claim `uid`; True if it existed. Idempotent. A link in its place
        is removed as a link (unlink never follows one)."""
        path = self.path_for(kind, uid)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        fsync_dir(path.parent)
        log.debug("removed CDI spec %s", path)
        return True

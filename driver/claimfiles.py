"""One claim's files on the node: where they are (derived from the validated claim UID), creating
them, and which of a prepared claim's files are missing.

Files of one claim (DATA = the plugin's data dir, 0700 root; the names and container paths are
sharing/claimlayout.py's):

    <cdi root>/k8s.<driver>-claim_<uid>.json  the CDI spec (one device named by the claim UID)
    DATA/claims/<uid>/                   0755 root, never mounted writable
    DATA/claims/<uid>/limits             0444: the claim's limits (sharing/limitsfile.py), mounted
                                         read-only beside the shim; the shim takes every limit
                                         from it, whatever the container's environment says
    DATA/claims/<uid>/metadata/<request>.json  0444: the device metadata of one request
                                         (driver/devicemetadata.py), mounted read-only alone
    DATA/claims/<uid>/shared/            0755 root, never mounted
    DATA/claims/<uid>/shared/accounting  0666: the slice's accounting file, created at prepare
                                         and bind-mounted alone, read-write, at
                                         /run/vgpu-sharing/accounting (a single-file mount: the
                                         tenant can write it but not rename, replace or add
                                         files beside it on the host)
    DATA/trash/                          0700 root: claim directories moved aside, removed
                                         outside the lock (driver/trash.py)
    DATA/node-state/<uid>.demand         0666, created empty: the claim's elastic-demand record,
                                         mounted writable only into this claim (/run/vgpu-demand);
                                         DATA/node-state is mounted read-only into every claim

Every path is derived from the claim UID (validated: letters, digits, '-', at most 128) inside
the plugin's own directories; nothing under DATA is opened through a link (driver/hostfs.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from driver import hostfs
from sharing import region
from sharing.claimlayout import (
    ACCOUNTING_FILE,
    BURST_POOL_FILE,
    LIMITS_FILE,
    METADATA_DIR,
    SHARED_DIR,
    TRASH_DIR,
)
from sharing.fsutil import atomic_write

CLAIM_CLASS = "claim"

# Kubernetes UIDs are UUIDs (36 characters); the bound keeps every derived file name short.
MAX_UID = 128
_UID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9\-]*")


def cdi_kind(driver_name: str) -> str:
    return f"k8s.{driver_name}/{CLAIM_CLASS}"


def uid_error(uid: str) -> str | None:
    """Why `uid` cannot be a claim UID, or None. Whole-string match: a trailing newline fails."""
    if len(uid) > MAX_UID:
        return f"claim UID of {len(uid)} characters invalid; allowed: at most {MAX_UID}"
    if not _UID_RE.fullmatch(uid):
        return f"claim UID {uid!r} invalid; allowed: letters, digits and '-', not starting with '-'"
    return None


@dataclass(frozen=True)
class HostPaths:
    """Host-side paths the CDI specs point at."""

    shim_library: Path  # <data dir>/lib/libvgpu.so
    preload_file: Path  # <data dir>/lib/ld.so.preload
    claims_dir: Path  # <data dir>/claims; one sub-directory per claim UID
    node_state_dir: Path  # <data dir>/node-state: one demand file per claim
    dev_root: Path = Path("/dev")

    @property
    def data_dir(self) -> Path:
        return self.claims_dir.parent

    @property
    def burst_pool(self) -> Path:
        """The node's burst pool file (driver/burst.py), mounted read-only into bursting claims."""
        return self.data_dir / BURST_POOL_FILE

    @property
    def trash_dir(self) -> Path:
        """Claim directories moved aside, removed outside the lock (same file system)."""
        return self.data_dir / TRASH_DIR


@dataclass(frozen=True)
class ClaimFiles:
    """Where one claim's files are, derived from its (validated) UID."""

    spec: Path
    claim_dir: Path
    demand: Path

    @property
    def limits(self) -> Path:
        return self.claim_dir / LIMITS_FILE

    @property
    def shared(self) -> Path:
        return self.claim_dir / SHARED_DIR

    @property
    def accounting(self) -> Path:
        return self.claim_dir / SHARED_DIR / ACCOUNTING_FILE

    def metadata(self, request: str) -> Path:
        """The device metadata file of a (validated) top-level request name."""
        return self.claim_dir / METADATA_DIR / f"{request}.json"

    def missing(self, metadata_requests: Iterable[str] = ()) -> list[str]:
        """The files of a prepared claim that are not (or not as regular files) in place;
        metadata_requests: the (validated) top-level requests it has a metadata file for."""
        files = (self.spec, self.limits, self.demand, *map(self.metadata, metadata_requests))
        out = [str(p) for p in files if not _is_regular(p)]
        if not hostfs.is_real_dir(self.shared):
            out.append(str(self.shared))
        elif not _is_regular(self.accounting):  # a bind-mount source: must exist
            out.append(str(self.accounting))
        return out


def write_claim_dir(paths: HostPaths, uid: str, files: ClaimFiles, limits_text: str) -> None:
    """Create (or complete) the claim's directory, limits file, shared directory, accounting file
    and demand file. Existing ones are kept (the shared directory holds the slice's usage),
    except the limits file, which is rewritten atomically."""
    for d in (paths.claims_dir, paths.node_state_dir):
        d.mkdir(mode=0o755, parents=True, exist_ok=True)  # gone since start (an operator?)
    with hostfs.open_dir(paths.claims_dir) as cfd:
        hostfs.make_dir(cfd, uid, 0o755)
    atomic_write(files.limits, limits_text.encode(), mode=0o444)
    with hostfs.open_dir(files.claim_dir) as dfd:
        # root's: the tenant gets the accounting file alone (a single-file bind mount), so
        # it can neither add files here nor rename or replace the file
        hostfs.make_dir(dfd, SHARED_DIR, 0o755)
    with hostfs.open_dir(files.shared) as sfd:
        if not hostfs.is_regular(sfd, ACCOUNTING_FILE):
            # an existing file is the slice's usage: kept
            hostfs.remove(files.accounting, files.shared)  # not a file of ours
            # Usage only, shared by the slice's processes; 0666: they may run as any user.
            # sharing.region.create makes it through an O_EXCL temporary file and link(),
            # neither of which follows a link, in a directory it checks (root's).
            region.create(files.accounting, mode=0o666)
    with hostfs.open_dir(paths.node_state_dir) as nfd:
        name = files.demand.name
        if not hostfs.is_regular(nfd, name):
            hostfs.remove(files.demand, paths.node_state_dir)  # not a file of ours
            hostfs.create_empty(nfd, name, 0o666)
        os.fsync(nfd)


def write_metadata(files: ClaimFiles, contents: dict[str, bytes]) -> None:
    """The claim's device metadata files (request -> content), root's and read-only; files of
    requests no longer named are removed."""
    with hostfs.open_dir(files.claim_dir) as dfd:
        hostfs.make_dir(dfd, METADATA_DIR, 0o755)
    meta_dir = files.claim_dir / METADATA_DIR
    for request, content in contents.items():
        atomic_write(files.metadata(request), content, mode=0o444)
    keep = {files.metadata(r).name for r in contents}
    for name in sorted(os.listdir(meta_dir)):
        if name not in keep:
            hostfs.remove(meta_dir / name, meta_dir)


def _is_regular(path: Path) -> bool:
    try:
        with hostfs.open_dir(path.parent) as dfd:
            return hostfs.is_regular(dfd, path.name)
    except FileNotFoundError:
        return False

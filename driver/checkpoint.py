"""The plugin's checkpoint: what unprepare needs, kept across restarts.

One JSON file in the plugin's data dir, replaced atomically on every change:

    {"version": 1, "checksum": "sha256:<hex>", "claims": {"<uid>": {...ClaimEntry...}}}

The checksum covers the canonical JSON of "claims"; a mismatch raises CheckpointError instead of
starting empty, because starting empty would silently forget prepared claims (their CDI specs
and accounting files would never be cleaned up, and a repeated prepare would re-read the API).

A claim goes PrepareStarted (recorded before anything is created, with the paths it will
create) -> PrepareCompleted (with the answer given to the kubelet) -> UnprepareStarted (recorded
before anything is removed) -> gone. At startup a PrepareStarted entry is a prepare that died
half-way: it is rolled back; an UnprepareStarted entry is an unprepare that died half-way: it is
finished. Entries also record each claim's memory per GPU (request, burst limit and grant
entry) and its prepare order, from which the burst pool is computed (driver/burst.py). Either
way the claim's files are found from its UID, inside the plugin's own
directories; the paths recorded here are only compared with those (driver/claimfiles.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver import hostfs
from sharing.fsutil import atomic_write

VERSION = 1
PREPARE_STARTED = "PrepareStarted"
PREPARE_COMPLETED = "PrepareCompleted"
UNPREPARE_STARTED = "UnprepareStarted"
_STATES = (PREPARE_STARTED, PREPARE_COMPLETED, UNPREPARE_STARTED)


class CheckpointError(Exception):
    """The checkpoint file cannot be trusted. str() is one line naming the file and the fault."""


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepare answer (the kubelet's `Device` message)."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_names": list(self.request_names),
            "pool_name": self.pool_name,
            "device_name": self.device_name,
            "cdi_device_ids": list(self.cdi_device_ids),
            "share_id": self.share_id,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PreparedDevice:
        return PreparedDevice(
            request_names=tuple(d["request_names"]),
            pool_name=d["pool_name"],
            device_name=d["device_name"],
            cdi_device_ids=tuple(d["cdi_device_ids"]),
            share_id=d.get("share_id"),
        )


@dataclass(frozen=True)
class ClaimMemory:
    """A claim's memory on one GPU, for the burst pool (driver/burst.py): its request and, when it
    bursts, its limit and its grant entry in the pool file with that entry's key."""

    gpu: int  # host GPU index
    request: int  # bytes
    limit: int = 0  # bytes; above request: it bursts
    entry: int = -1
    key: int = 0

    @property
    def bursts(self) -> bool:
        return self.limit > self.request

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"gpu": self.gpu, "request": self.request}
        if self.bursts:
            d.update(limit=self.limit, entry=self.entry, key=self.key)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ClaimMemory:
        m = ClaimMemory(gpu=int(d["gpu"]), request=int(d["request"]), limit=int(d.get("limit", 0)),
                        entry=int(d.get("entry", -1)), key=int(d.get("key", 0)))  # fmt: skip
        if m.bursts and not (m.entry >= 0 and m.key > 0):
            raise ValueError(f"memory entry {d!r}: a burst limit needs a grant entry and key")
        return m


@dataclass(frozen=True)
class ClaimEntry:
    uid: str
    namespace: str
    name: str
    state: str
    cdi_spec: str  # path of the claim's CDI spec file
    claim_dir: str  # path of the claim's accounting directory
    devices: tuple[PreparedDevice, ...] = field(default=())
    # per GPU its request (and burst limit); None: recorded by a plugin that did not record it
    memory: tuple[ClaimMemory, ...] | None = None
    seq: int = 0  # prepare order (the burst pool's grants go oldest first)
    # a burst reclaim this claim's prepare started and has not finished (driver/state.py):
    # {"policy": "evict"|"wait", "deadline_unix_ns": int, "borrowers": [[uid, gpu], ...]}
    reclaim: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.memory is not None:
            extra = {"memory": [m.to_dict() for m in self.memory], "seq": self.seq}
        if self.reclaim is not None:
            extra["reclaim"] = self.reclaim
        return extra | {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "state": self.state,
            "cdi_spec": self.cdi_spec,
            "claim_dir": self.claim_dir,
            "devices": [d.to_dict() for d in self.devices],
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ClaimEntry:
        if d.get("state") not in _STATES:
            raise ValueError(f"state {d.get('state')!r} unknown; allowed: {', '.join(_STATES)}")
        return ClaimEntry(
            uid=d["uid"],
            namespace=d["namespace"],
            name=d["name"],
            state=d["state"],
            cdi_spec=d["cdi_spec"],
            claim_dir=d["claim_dir"],
            devices=tuple(PreparedDevice.from_dict(x) for x in d.get("devices", [])),
            memory=(
                None
                if d.get("memory") is None
                else tuple(ClaimMemory.from_dict(x) for x in d["memory"])
            ),
            seq=int(d.get("seq", 0)),
            reclaim=_reclaim(d.get("reclaim")),
        )


def _reclaim(r: Any) -> dict[str, Any] | None:
    """A reclaim's record: each borrower as [uid, gpu, policy, deadline (unix ns)]. A record
    of an older plugin ([uid, gpu], one policy and deadline for all) is read into that form."""
    if r is None:
        return None
    if not (
        isinstance(r, dict)
        and r.get("policy") in ("evict", "wait")
        and isinstance(r.get("deadline_unix_ns"), int)
        and isinstance(r.get("borrowers"), list)
        and all(isinstance(b, list) and len(b) in (2, 4) for b in r["borrowers"])
    ):
        raise ValueError(f"reclaim record {r!r} invalid")
    borrowers = []
    for b in r["borrowers"]:
        uid, gpu, policy, deadline = b if len(b) == 4 else [*b, r["policy"], r["deadline_unix_ns"]]
        if policy not in ("evict", "wait") or not isinstance(deadline, int):
            raise ValueError(f"reclaim record {r!r} invalid")
        borrowers.append([str(uid), int(gpu), policy, deadline])
    return {"policy": r["policy"], "deadline_unix_ns": r["deadline_unix_ns"],
            "borrowers": borrowers}  # fmt: skip


def _checksum(claims: dict[str, Any]) -> str:
    canonical = json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


class Checkpoint:
    """The checkpoint file and its in-memory copy. Not thread-safe: the caller serialises."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._claims: dict[str, ClaimEntry] = {}
        self._docs: dict[str, dict[str, Any]] = {}  # serialised entries, kept in step

    def load(self) -> None:
        """Read the file (absent = no claims). CheckpointError when it is corrupt."""
        try:
            raw = hostfs.read_file(self.path)  # a link in its place is an error, not followed
        except FileNotFoundError:
            self._claims, self._docs = {}, {}
            return
        except OSError as e:
            raise CheckpointError(f"checkpoint {self.path} cannot be read: {e}") from e
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {self.path} is corrupt: not JSON ({e})") from e
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            version = doc.get("version") if isinstance(doc, dict) else None
            raise CheckpointError(
                f"checkpoint {self.path}: version {version!r} unsupported; allowed: {VERSION}"
            )
        claims = doc.get("claims")
        if not isinstance(claims, dict):
            raise CheckpointError(f"checkpoint {self.path} is corrupt: 'claims' is not an object")
        expected = doc.get("checksum")
        actual = _checksum(claims)
        if expected != actual:
            raise CheckpointError(
                f"checkpoint {self.path} is corrupt: checksum {expected} does not match the "
                f"content ({actual}); move it aside to start without the claims it records"
            )
        try:
            self._claims = {uid: ClaimEntry.from_dict(e) for uid, e in claims.items()}
            self._docs = {uid: e.to_dict() for uid, e in self._claims.items()}
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint {self.path} is corrupt: bad claim entry ({e})"
            ) from e

    def _save(self) -> None:
        claims = dict(sorted(self._docs.items()))
        doc = {"version": VERSION, "checksum": _checksum(claims), "claims": claims}
        # Compact: the C encoder is several times faster than the indenting pure-Python one.
        data = json.dumps(doc, separators=(",", ":")) + "\n"
        atomic_write(self.path, data.encode(), mode=0o600)

    def get(self, uid: str) -> ClaimEntry | None:
        return self._claims.get(uid)

    def entries(self) -> list[ClaimEntry]:
        return list(self._claims.values())

    def put(self, entry: ClaimEntry) -> None:
        """Record an entry durably (the file is replaced before this returns)."""
        previous = self._claims.get(entry.uid)
        self._claims[entry.uid] = entry
        self._docs[entry.uid] = entry.to_dict()
        try:
            self._save()
        except BaseException:
            # Keep memory equal to disk: a failed write must not leave a phantom entry.
            if previous is None:
                self._claims.pop(entry.uid, None)
                self._docs.pop(entry.uid, None)
            else:
                self._claims[entry.uid] = previous
                self._docs[entry.uid] = previous.to_dict()
            raise

    def delete(self, uid: str) -> None:
        previous = self._claims.pop(uid, None)
        if previous is None:
            return
        self._docs.pop(uid, None)
        try:
            self._save()
        except BaseException:
            self._claims[uid] = previous
            self._docs[uid] = previous.to_dict()
            raise

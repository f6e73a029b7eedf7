"""The slices of this node, found from outside: the DRA plugin's data directory, plus any
accounting files named on the command line (`vgpu run --region FILE`).

Driver layout (driver/state.py, driver/checkpoint.py), read here without importing the driver:

    <data-dir>/checkpoint.json               {"claims": {"<uid>": {"namespace", "name", "state",
                                               "cdi_spec", "claim_dir", ...}}}
    <data-dir>/claims/<claim-uid>/accounting the slice's accounting file (its region)
    <cdi_spec>                                the claim's CDI spec: CUDA_VISIBLE_DEVICES (the
                                              GPUs of the slice, in slice-device order) and the
                                              CUDA_DEVICE_*_LIMIT_<i> the container gets

Discovery runs at every scrape (a directory listing); the checkpoint and the CDI specs are parsed
again only when their modification time changes. A claim appears once its directory holds an
accounting file and disappears with it: no restart.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sharing.counters import SliceCounters

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path("/var/lib/vgpu-sharing")  # the plugin's --data-dir default
ACCOUNTING_FILE = "accounting"  # driver/state.py
CHECKPOINT_FILE = "checkpoint.json"


# (namespace, claim name, claim uid) -> the pod(s) the claim is reserved for, "" when unknown.
# The plugin passes one backed by the API server (status.reservedFor).
PodLookup = Callable[[str, str, str], str]


@dataclass(frozen=True)
class Slice:
    """One slice: a prepared claim, or an accounting file named on the command line."""

    key: str  # unique: the claim UID, or "region:<path>"
    claim_uid: str  # "" for a --region slice
    namespace: str  # "" when unknown
    claim: str  # the claim's name; the file's path for a --region slice
    pod: str  # "" when unknown
    region_path: str
    gpu_uuids: tuple[str, ...]  # physical GPU of slice device i; () = device i is NVML index i
    env: Mapping[str, str]  # the limits the plugin gave the containers (CDI env), if known


@dataclass(frozen=True)
class SliceLimits:
    """A slice's limits on one of its devices."""

    memory_bytes: int  # 0 = no quota
    compute_ratio: float  # 0 = no cap; 0.3 = 30 % of the SMs


def slice_limits(s: Slice, counters: SliceCounters, device: int) -> SliceLimits:
    """THE one place the observers learn a slice's limits.

    Today: the CUDA_DEVICE_*_LIMIT_<i> the plugin put in the claim's CDI spec, else what the
    accounting file recorded (the creator's memory limit, the compute gate's cap).
    """
    memory = _env_int(s.env, f"CUDA_DEVICE_MEMORY_LIMIT_{device}")
    sm = _env_int(s.env, f"CUDA_DEVICE_SM_LIMIT_{device}")
    dc = counters.devices[device] if device < len(counters.devices) else None
    if memory is None:
        memory = dc.limit if dc else 0
    if sm is not None:
        ratio = sm / 100.0 if 0 < sm < 100 else 0.0
    else:
        ratio = dc.cap_permille / 1000.0 if dc and 0 < dc.cap_permille < 1000 else 0.0
    return SliceLimits(memory_bytes=memory, compute_ratio=ratio)


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    v = env.get(key)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        return None


def region_slice(path: str) -> Slice:
    p = os.path.abspath(path)
    return Slice(
        key=f"region:{p}",
        claim_uid="",
        namespace="",
        claim=p,
        pod="",
        region_path=p,
        gpu_uuids=(),
        env={},
    )


class _MtimeCache:
    """Parse a file again only when its (mtime, size, inode) changes."""

    def __init__(self) -> None:
        self._key: dict[str, tuple[int, int, int]] = {}
        self._value: dict[str, Any] = {}

    def get(self, path: str) -> Any:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            self._key.pop(path, None)
            self._value.pop(path, None)
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if self._key.get(path) != key:
            self._key[path] = key
            self._value[path] = _load_json(path) if stat.S_ISREG(st.st_mode) else None
        return self._value[path]

    def forget_except(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        for p in list(self._key):
            if p not in keep:
                del self._key[p]
                self._value.pop(p, None)


def _load_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable (%s); its claims are shown without names", path, e)
        return None


def _cdi_env(doc: Any) -> dict[str, str]:
    """The env of the first device's containerEdits of a CDI spec (the driver writes one)."""
    env: dict[str, str] = {}
    try:
        for dev in doc.get("devices", []):
            for item in dev.get("containerEdits", {}).get("env", []):
                k, _, v = str(item).partition("=")
                env[k] = v
    except AttributeError:
        return {}
    return env


class SliceFinder:
    """Finds the slices at every call of find(). Not thread-safe: one per caller."""

    def __init__(
        self, data_dir: Path | None, regions: Sequence[str] = (), pods: PodLookup | None = None
    ) -> None:
        self.data_dir = data_dir
        self.regions = tuple(regions)
        self.pods = pods
        self._json = _MtimeCache()

    def find(self) -> list[Slice]:
        out = [region_slice(p) for p in self.regions]
        if self.data_dir is not None:
            out.extend(self._claims(self.data_dir))
        return out

    def _claims(self, data_dir: Path) -> list[Slice]:
        claims_dir = data_dir / "claims"
        try:
            uids = sorted(e.name for e in os.scandir(claims_dir) if e.is_dir(follow_symlinks=False))
        except OSError:
            return []
        ckpt = self._json.get(str(data_dir / CHECKPOINT_FILE))
        entries = ckpt.get("claims", {}) if isinstance(ckpt, dict) else {}
        seen = [str(data_dir / CHECKPOINT_FILE)]
        out = []
        for uid in uids:
            acct = claims_dir / uid / ACCOUNTING_FILE
            try:
                if not stat.S_ISREG(os.stat(acct, follow_symlinks=False).st_mode):
                    continue
            except OSError:
                continue  # being prepared, or being removed
            e = entries.get(uid) if isinstance(entries, dict) else None
            e = e if isinstance(e, dict) else {}
            env: dict[str, str] = {}
            spec = e.get("cdi_spec")
            if isinstance(spec, str):
                seen.append(spec)
                env = _cdi_env(self._json.get(spec))
            ns, name = str(e.get("namespace", "")), str(e.get("name", ""))
            uuids = env.get("CUDA_VISIBLE_DEVICES", "")
            out.append(
                Slice(
                    key=uid,
                    claim_uid=uid,
                    namespace=ns,
                    claim=name,
                    pod=self.pods(ns, name, uid) if self.pods and name else "",
                    region_path=str(acct),
                    gpu_uuids=tuple(u for u in uuids.split(",") if u),
                    env=env,
                )
            )
        self._json.forget_except(seen)
        return out

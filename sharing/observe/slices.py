"""The slices of this node, found from outside: the DRA plugin's data directory, plus any
accounting files named on the command line (`vgpu run --region FILE`).

The plugin's data directory as sharing/claimlayout.py lays it out: the checkpoint
(`{"claims": {"<uid>": {"namespace", "name", "state", "cdi_spec", "claim_dir", ...}}}`,
driver/checkpoint.py), each claim's limits file (sharing/limitsfile.py: the authority, the one the
shim enforces) and accounting file (usage only), and each claim's CDI spec, whose
CUDA_VISIBLE_DEVICES names the GPUs of the slice in slice-device order.

A `vgpu run --region FILE` slice has its limits beside it in FILE.limits (same format, written
by `vgpu run`; the shim itself takes them from the command's environment).

Discovery runs at every scrape (a directory listing); the checkpoint and the CDI specs are parsed
again only when their modification time changes. A claim appears once its directory holds an
accounting file and disappears with it: no restart. Every file is read without following a link
(a tenant can write in its claim's shared/ directory).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharing import claimlayout as layout
from sharing.counters import SliceCounters
from sharing.limitsfile import MAX_FILE_BYTES, LimitsFileError, parse_limits_file

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(layout.DEFAULT_DATA_DIR)  # the plugin's --data-dir default


# (namespace, claim name, claim uid) -> the pod(s) the claim is reserved for, "" when unknown.
# The plugin passes one backed by the API server (status.reservedFor).
PodLookup = Callable[[str, str, str], str]


@dataclass(frozen=True, order=True)
class PodContainer:
    """A container the kubelet gave a claim to (its PodResources API: sharing/observe/podresources.py)."""

    namespace: str
    pod: str
    container: str


# the claim's own CDI device names -> the containers holding them, () when unknown
HolderLookup = Callable[[Sequence[str]], tuple[PodContainer, ...]]


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
    env: Mapping[str, str]  # the env the plugin gave the containers (CDI spec), if known
    region_id: tuple[int, int] | None = None  # (st_dev, st_ino) of region_path when found
    limits: Mapping[str, str] = field(default_factory=dict)  # its limits file, {} if unknown
    # (pool, device) of each device the plugin prepared for the claim (its checkpoint), as the
    # claim's allocation names them: the dra_pool_name/dra_device_name labels
    dra_devices: tuple[tuple[str, str], ...] = ()
    # the CDI devices the plugin prepared for this claim alone (`<kind>=<claim uid>`, from its
    # checkpoint): what the kubelet's PodResources API names the claim's containers by
    cdi_devices: tuple[str, ...] = ()
    # the containers the kubelet gave the claim to, sorted; () when unknown
    holders: tuple[PodContainer, ...] = ()
    # the plugin's burst pool file on the host (<data-dir>/burst-pool) for a claim of the plugin,
    # "" for a --region slice: where the watchdog reads a bursting slice's grant
    burst_pool: str = ""


@dataclass(frozen=True)
class SliceLimits:
    """A slice's limits on one of its devices."""

    memory_bytes: int  # 0 = no quota (under bursting: the request)
    compute_ratio: float  # 0 = no cap; 0.3 = 30 % of the SMs
    memory_burst_bytes: int = 0  # bursting (docs/policy.md): the limit above the request, 0 = none


def compute_policy(s: Slice) -> str:
    """The compute policy the slice runs under, as its limits file says (the shim enforces
    that one, whatever the tenant's environment says): hard, elastic or off; "" when the
    slice's limits are unknown. The `compute_policy` label and `vgpu top`'s policy column."""
    return s.limits.get("VGPU_COMPUTE_POLICY", "") if s.limits else ""


def slice_limits(s: Slice, counters: SliceCounters, device: int) -> SliceLimits:
    """THE one place the observers learn a slice's limits: its limits file (the plugin's for a
    claim, FILE.limits for a `vgpu run --region FILE` slice), never the accounting file (which
    holds usage only). Unknown limits read as none."""
    memory = _int(s.limits.get(f"CUDA_DEVICE_MEMORY_LIMIT_{device}"))
    sm = _float(s.limits.get(f"CUDA_DEVICE_SM_LIMIT_{device}"))
    policy = compute_policy(s)
    ratio = sm / 100.0 if sm is not None and 0 < sm < 100 and policy != "off" else 0.0
    burst = _int(s.limits.get(f"VGPU_MEMORY_BURST_LIMIT_{device}")) or 0
    return SliceLimits(
        memory_bytes=memory or 0,
        compute_ratio=ratio,
        memory_burst_bytes=burst if memory and burst > memory else 0,
    )


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _float(v: str | None) -> float | None:
    try:
        return float(v.strip().rstrip("%")) if v is not None else None
    except ValueError:
        return None


def read_limits(path: str) -> dict[str, str]:
    """A limits file's pairs ({} when absent, a link, or not valid: logged once by the caller)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        with os.fdopen(os.dup(fd), "rb") as f:
            text = f.read(MAX_FILE_BYTES + 1).decode("utf-8", "replace")
    finally:
        os.close(fd)
    try:
        return parse_limits_file(text)
    except LimitsFileError as e:
        log.warning("%s: %s; the slice is shown without limits", path, e)
        return {}


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
        limits=read_limits(p + layout.REGION_LIMITS_SUFFIX),
    )


class _MtimeCache:
    """Parse a file again only when its (mtime, size, inode) changes."""

    def __init__(self, load: Callable[[str], Any]) -> None:
        self._load = load
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
            self._value[path] = self._load(path) if stat.S_ISREG(st.st_mode) else None
        return self._value[path]


def _load_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:  # plugin-owned files (checkpoint, CDI specs)
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
        self,
        data_dir: Path | None,
        regions: Sequence[str] = (),
        pods: PodLookup | None = None,
        holders: HolderLookup | None = None,
    ) -> None:
        """pods: the pods a claim is reserved for (used when `holders` has no answer);
        holders: the containers the kubelet gave a claim to."""
        self.data_dir = data_dir
        self.regions = tuple(regions)
        self.pods = pods
        self.holders = holders
        self._json = _MtimeCache(_load_json)
        self._limits = _MtimeCache(read_limits)
        self._ckpt: Any = None
        self._meta: dict[str, _ClaimMeta] = {}

    def find(self) -> list[Slice]:
        out = [region_slice(p) for p in self.regions]
        if self.data_dir is not None:
            out.extend(self._claims(self.data_dir))
        return out

    def _claims(self, data_dir: Path) -> list[Slice]:
        claims_dir = os.path.join(data_dir, layout.CLAIMS_DIR)
        try:
            with os.scandir(claims_dir) as it:
                uids = sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            return []
        ckpt = self._json.get(os.path.join(data_dir, layout.CHECKPOINT_FILE))
        if ckpt is not self._ckpt:  # the checkpoint changed (every prepare and unprepare does)
            self._ckpt, self._meta = ckpt, {}
        out = []
        for uid in uids:
            acct = layout.claim_accounting(claims_dir, uid)
            try:
                st = os.stat(acct, follow_symlinks=False)
            except OSError:
                continue  # being prepared, or being removed
            if not stat.S_ISREG(st.st_mode):
                continue
            meta = self._meta.get(uid)
            if meta is None:
                meta = self._meta[uid] = _claim_meta(ckpt, uid)
            ns, name, env, dra_devices, cdi_devices = meta
            uuids = env.get("CUDA_VISIBLE_DEVICES", "")
            holders = self.holders(cdi_devices) if self.holders and cdi_devices else ()
            if holders:
                pod = ",".join(sorted({h.pod for h in holders}))
            else:
                pod = self.pods(ns, name, uid) if self.pods and name else ""
            out.append(
                Slice(
                    key=uid,
                    claim_uid=uid,
                    namespace=ns,
                    claim=name,
                    pod=pod,
                    region_path=acct,
                    gpu_uuids=tuple(u for u in uuids.split(",") if u),
                    env=env,
                    region_id=(st.st_dev, st.st_ino),
                    limits=self._limits.get(layout.claim_limits(claims_dir, uid)) or {},
                    dra_devices=dra_devices,
                    cdi_devices=cdi_devices,
                    holders=holders,
                    burst_pool=os.path.join(data_dir, layout.BURST_POOL_FILE),
                )
            )
        return out


_ClaimMeta = tuple[str, str, dict[str, str], tuple[tuple[str, str], ...], tuple[str, ...]]


def _claim_meta(ckpt: Any, uid: str) -> _ClaimMeta:
    """(namespace, name, CDI env, (pool, device) of each prepared device, the claim's own CDI
    devices) of a claim from the checkpoint and its CDI spec. The spec is written once at
    prepare: it is read again only when the checkpoint changes. A prepared device also lists
    NVIDIA's CDI devices (shared by every claim on the GPU): only those naming the claim's UID
    are the claim's own."""
    entries = ckpt.get("claims", {}) if isinstance(ckpt, dict) else {}
    e = entries.get(uid) if isinstance(entries, dict) else None
    e = e if isinstance(e, dict) else {}
    spec = e.get("cdi_spec")
    env = _cdi_env(_load_json(spec)) if isinstance(spec, str) else {}
    devices = e.get("devices")
    entries_ = [d for d in (devices if isinstance(devices, list) else []) if isinstance(d, dict)]
    dra = tuple((str(d.get("pool_name", "")), str(d.get("device_name", ""))) for d in entries_)
    own: list[str] = []
    for d in entries_:
        ids = d.get("cdi_device_ids")
        for i in ids if isinstance(ids, list) else []:
            if isinstance(i, str) and i.partition("=")[2] == uid and i not in own:
                own.append(i)
    return str(e.get("namespace", "")), str(e.get("name", "")), env, dra, tuple(own)

"""Prepare and unprepare of claims on this node: the DeviceState.

Files of one claim (DATA = the plugin's data dir, 0700 root; the names and container paths are
sharing/claimlayout.py's):

    <cdi root>/k8s.<driver>-claim_<uid>.json  the CDI spec (one device named by the claim UID)
    DATA/claims/<uid>/                   0755 root, never mounted writable
    DATA/claims/<uid>/limits             0444: the claim's limits (sharing/limitsfile.py), mounted
                                         read-only beside the shim; the shim takes every limit
                                         from it, whatever the container's environment says
    DATA/claims/<uid>/shared/            0755 root, never mounted
    DATA/claims/<uid>/shared/accounting  0666: the slice's accounting file, created at prepare
                                         and bind-mounted alone, read-write, at
                                         /run/vgpu-sharing/accounting (a single-file mount: the
                                         tenant can write it but not rename, replace or add
                                         files beside it on the host)
    DATA/trash/                          0700 root: claim directories moved aside, removed
                                         outside the lock (below)
    DATA/node-state/<uid>.demand         0666, created empty: the claim's elastic-demand record,
                                         mounted writable only into this claim (/run/vgpu-demand);
                                         DATA/node-state is mounted read-only into every claim

Prepare of one claim:
  1. a PrepareCompleted checkpoint entry whose files all exist -> return its recorded answer (no
     API call). If one is missing (e.g. /var/run/cdi is a tmpfs and the node rebooted), the
     claim is read again and the missing files are recreated; an existing shared/ directory
     (the slice's usage) is kept;
  2. read the ResourceClaim, check it and compute the limits (driver/claims.py);
  3. checkpoint PrepareStarted;
  4. create the claim directory, limits file, shared directory, accounting file, demand file;
     write the CDI spec;
  5. checkpoint PrepareCompleted with the answer, return it.
A failure after 3 removes what was created and the entry; a crash after 3 is rolled back at the
next start (recover()). Unprepare checkpoints UnprepareStarted before removing anything, so a
crash half-way is finished at the next start, never taken for a prepared claim.

A claim directory is removed in two steps: under the lock it is renamed into DATA/trash (one
system call, whatever it holds: a claim prepared by an older layout had a tenant-writable
directory); after the lock one background thread removes the moved tree
(driver/hostfs.remove_tree: iterative, bounded descriptors), so a huge tree never holds up other
claims nor the kubelet's call. What a stop or crash leaves in the trash is removed after the next
start.

Every path is derived from the claim UID (validated: letters, digits, '-', at most 128) inside
the plugin's own directories; nothing under DATA is opened through a link (driver/hostfs.py).

One claim = one CDI device `k8s.<driver>/claim=<claim-uid>` carrying every GPU of the claim, and
one accounting directory: all containers of a pod that use the claim share one quota; two claims
never share a directory, even on the same GPU.

Test hook: VGPU_TEST_CRASH_AT=<step> makes the process SIGKILL itself at that step (steps:
CRASH_STEPS). It is read from the environment on each call; production never sets it.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cdi.spec import ContainerEdits, Device, DeviceNode, Mount, Spec
from cdi.writer import SpecWriter
from driver import hostfs
from driver.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    UNPREPARE_STARTED,
    Checkpoint,
    ClaimEntry,
    PreparedDevice,
)
from driver.claims import ClaimError, ClaimPlan, ClaimRef, RulesFor, plan_claim, read_claim
from driver.injection import NO_INJECTION, DriverInjector, Injection
from driver.injection import apply as apply_injection
from sharing import region
from sharing.claimlayout import (
    ACCOUNTING_FILE,
    CONTAINER_ACCOUNTING,
    CONTAINER_DEMAND_FILE,
    CONTAINER_LIB,
    CONTAINER_LIMITS,
    CONTAINER_NODE_STATE_DIR,
    CONTAINER_PRELOAD,
    DEMAND_SUFFIX,
    LIMITS_FILE,
    SHARED_DIR,
    TRASH_DIR,
    demand_name,
)
from sharing.fsutil import atomic_write
from sharing.gpus import GpuInfo
from sharing.limitsfile import render_limits_file

log = logging.getLogger(__name__)

CRASH_ENV = "VGPU_TEST_CRASH_AT"
CRASH_STEPS = (
    "prepare-started",  # after the PrepareStarted checkpoint
    "prepare-dir",  # after the claim directory, limits, shared dir and demand file exist
    "prepare-cdi",  # after the CDI spec is written
    "prepare-completed",  # after the PrepareCompleted checkpoint, before answering
    "unprepare-started",  # after the UnprepareStarted checkpoint
    "unprepare-cdi",  # after the CDI spec is removed
    "unprepare-dir",  # after the directory and demand file are removed, before the entry goes
)

CLAIM_CLASS = "claim"

# Kubernetes UIDs are UUIDs (36 characters); the bound keeps every derived file name short.
MAX_UID = 128
_UID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9\-]*")
_RO = ("ro", "nosuid", "nodev", "bind")
_RW = ("rw", "nosuid", "nodev", "bind")

ClaimReader = Callable[[ClaimRef], dict[str, Any]]


def _maybe_crash(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        log.warning("test hook %s=%s: killing this process", CRASH_ENV, step)
        os.kill(os.getpid(), signal.SIGKILL)


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
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


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


class DeviceState:
    """Prepared claims of this node. Thread-safe: changes to files and checkpoint are serialised
    by one lock; reading claims from the API server happens outside it."""

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        gpus: Sequence[GpuInfo],
        mode: str,
        partitions: int,
        cdi_root: Path,
        checkpoint_path: Path,
        paths: HostPaths,
        read: ClaimReader,
        rules_for: RulesFor | None = None,
        injector: DriverInjector | None = None,
    ) -> None:
        self.driver_name = driver_name
        self.node_name = node_name
        self.gpus = list(gpus)
        self.mode = mode
        self.partitions = partitions
        self.kind = cdi_kind(driver_name)
        self.writer = SpecWriter(cdi_root)
        self.checkpoint = Checkpoint(checkpoint_path)
        self.paths = paths
        self._read = read
        self.rules_for = rules_for  # the admin policy per GPU (None: built-in)
        self.injector = injector  # the driver's files for CDI-only runtimes (driver/injection.py)
        self._lock = threading.Lock()
        self._trash: list[str] = []  # names moved into the trash under the lock, not yet queued
        self._remover = _TrashRemover(paths.trash_dir)

    def set_gpus(self, gpus: Sequence[GpuInfo]) -> None:
        """Plan later claims on these GPUs (rediscovery saw GPUs appear or go). Prepared claims
        keep their specs; device names map to GPUs by index, so a GPU at a reused index is the
        new one."""
        with self._lock:
            self.gpus = list(gpus)

    @staticmethod
    def api_reader(api_client: Any) -> ClaimReader:
        return lambda ref: read_claim(api_client, ref)

    def files(self, uid: str) -> ClaimFiles:
        """The claim's paths; call only with a UID that passed uid_error()."""
        return ClaimFiles(
            spec=self.writer.path_for(self.kind, uid),
            claim_dir=self.paths.claims_dir / uid,
            demand=self.paths.node_state_dir / demand_name(uid),
        )

    # --- startup -----------------------------------------------------------------------------

    def recover(self) -> None:
        """Load the checkpoint, roll back interrupted prepares, finish interrupted unprepares,
        remove orphans. A failure on one entry or file is logged and the rest goes on.

        Raises CheckpointError when the checkpoint is corrupt (never silently starts empty).
        """
        with self._lock:
            self.checkpoint.load()
            for entry in self.checkpoint.entries():
                try:
                    self._recover_entry(entry)
                except Exception as e:  # any error: one claim must not stop the plugin's start
                    log.error(
                        "claim %s/%s (%r): recovery failed: %s; continuing with the others",
                        entry.namespace,
                        entry.name,
                        entry.uid,
                        e,
                    )
            self._remove_orphans()
            log.info("checkpoint %s: %d prepared claims", self.checkpoint.path,
                     len(self.checkpoint.entries()))  # fmt: skip
            self._trash = []
            leftovers = self._list_trash()  # this start's moves and what a crash left
        self._remover.put(leftovers)

    def _recover_entry(self, entry: ClaimEntry) -> None:
        what = f"claim {entry.namespace}/{entry.name} ({entry.uid!r})"
        if err := uid_error(entry.uid):
            # No file of ours can carry this name; whatever carries a similar one is an orphan.
            log.error("%s in the checkpoint: %s; dropping the entry", what, err)
            self.checkpoint.delete(entry.uid)
            return
        if entry.state == PREPARE_STARTED:
            log.warning("%s: rolling back a prepare interrupted by a restart", what)
        elif entry.state == UNPREPARE_STARTED:
            log.warning("%s: finishing an unprepare interrupted by a restart", what)
        else:
            return
        self._remove_artifacts(entry)
        self.checkpoint.delete(entry.uid)

    def _remove_orphans(self) -> None:
        """Files of ours that no checkpoint entry owns (defence in depth), and temporary files
        of writes a crash cut short. One failure is logged; the sweep goes on."""
        known = {e.uid for e in self.checkpoint.entries()}
        prefix = f"{self.kind.replace('/', '-')}_"
        sweeps: list[tuple[Path, Callable[[str], bool]]] = [
            (self.writer.cdi_root, lambda n: (n.startswith(prefix) and n.endswith(".json")
                                              and n[len(prefix) : -len(".json")] not in known)
                                             or (n.startswith(f".{prefix}") and n.endswith(".tmp"))),
            (self.paths.claims_dir, lambda n: n not in known),
            (self.paths.node_state_dir, lambda n: n.endswith(DEMAND_SUFFIX)
                                                  and n[: -len(DEMAND_SUFFIX)] not in known),
            (self.checkpoint.path.parent, lambda n: n.startswith(f".{self.checkpoint.path.name}.")
                                                    and n.endswith(".tmp")),
        ]  # fmt: skip
        for root, orphan in sweeps:
            try:
                names = sorted(os.listdir(root))
            except FileNotFoundError:
                continue
            except OSError as e:
                log.error("cannot list %s for orphans: %s", root, e)
                continue
            for name in filter(orphan, names):
                try:
                    if root == self.paths.claims_dir:
                        removed = self._move_to_trash(root / name)
                    else:
                        removed = hostfs.remove(root / name, root)
                    if removed:
                        log.warning("removed orphan %s", root / name)
                except Exception as e:
                    log.error("cannot remove orphan %s: %s; continuing", root / name, e)

    # --- the trash ---------------------------------------------------------------------------

    def _move_to_trash(self, path: Path) -> bool:
        """Move the claim directory `path` into the trash (call with the lock held); True if
        something was there. The caller hands the moved names to the remover after the lock."""
        trash = self.paths.trash_dir
        trash.mkdir(mode=0o700, exist_ok=True)
        try:
            name = hostfs.move_aside(path, self.paths.claims_dir, trash)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            # claims/ is another file system than DATA (an admin's mount): removed in place
            return hostfs.remove(path, self.paths.claims_dir)
        if name is None:
            return False
        self._trash.append(name)
        return True

    def _take_trash(self) -> list[str]:
        with self._lock:
            names, self._trash = self._trash, []
        return names

    def _list_trash(self) -> list[str]:
        try:
            return sorted(os.listdir(self.paths.trash_dir))
        except FileNotFoundError:
            return []
        except OSError as e:
            log.error("cannot list %s: %s", self.paths.trash_dir, e)
            return []

    def trash_idle(self, timeout: float) -> bool:
        """Wait until every queued removal is done (tests; False on timeout)."""
        return self._remover.idle(timeout)

    # --- prepare -----------------------------------------------------------------------------

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare each claim; a claim's failure is its own PrepareResult.error."""
        out: dict[str, PrepareResult] = {}
        for ref in claims:
            try:
                out[ref.uid] = PrepareResult(devices=self._prepare_one(ref))
            except ClaimError as e:
                log.warning("claim %s: prepare failed: %s", ref, e)
                out[ref.uid] = PrepareResult(error=str(e))
            except Exception as e:
                log.exception("claim %s: prepare failed", ref)
                out[ref.uid] = PrepareResult(error=f"prepare failed: {e}")
        self._remover.put(self._take_trash())  # leftovers under these claims' names
        return out

    def _missing(self, uid: str) -> list[str]:
        """The files of a prepared claim that are not (or not as regular files) in place."""
        f = self.files(uid)
        missing = [str(p) for p in (f.spec, f.limits, f.demand) if not _is_regular(p)]
        if not hostfs.is_real_dir(f.shared):
            missing.append(str(f.shared))
        elif not _is_regular(f.accounting):  # a bind-mount source: must exist
            missing.append(str(f.accounting))
        return missing

    def _completed(self, ref: ClaimRef) -> tuple[tuple[PreparedDevice, ...] | None, list[str]]:
        """The recorded answer of a completed prepare whose files all exist, else None and the
        missing files (call with the lock held)."""
        entry = self.checkpoint.get(ref.uid)
        if entry is None or entry.state != PREPARE_COMPLETED:
            return None, []
        missing = self._missing(ref.uid)
        if missing:
            return None, missing
        log.debug("claim %s: already prepared", ref)
        return entry.devices, []

    def _prepare_one(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        if err := uid_error(ref.uid):
            raise ClaimError(err)
        with self._lock:
            done, missing = self._completed(ref)
        if done is not None:
            return done
        if missing:
            log.warning("claim %s: prepared, but %s missing; recreating from the ResourceClaim",
                        ref, ", ".join(missing))  # fmt: skip
        # The API read is the slow part: outside the lock, so that one slow claim does not hold
        # up prepares and unprepares of other pods.
        try:
            claim = self._read(ref)
        except ClaimError as e:
            if missing:
                raise ClaimError(
                    f"prepared earlier, but {', '.join(missing)} is gone and reading the claim "
                    f"to recreate it failed: {e}"
                ) from e
            raise
        with self._lock:
            done, missing = self._completed(ref)  # a concurrent call may have got there first
            if done is not None:
                return done
            entry = self.checkpoint.get(ref.uid)
            if entry is not None and entry.state == PREPARE_COMPLETED:
                return self._repair(ref, claim, entry)
            return self._create(ref, claim)

    def _plan(self, ref: ClaimRef, claim: dict[str, Any]) -> ClaimPlan:
        return plan_claim(
            claim,
            ref,
            driver_name=self.driver_name,
            node_name=self.node_name,
            gpus=self.gpus,
            mode=self.mode,
            partitions=self.partitions,
            rules_for=self.rules_for,
        )

    def _create(self, ref: ClaimRef, claim: dict[str, Any]) -> tuple[PreparedDevice, ...]:
        files = self.files(ref.uid)
        entry = self.checkpoint.get(ref.uid)
        if entry is not None:  # PrepareStarted left by a failure, or UnprepareStarted: start over
            self._remove_artifacts(entry)
            self.checkpoint.delete(ref.uid)
        plan = self._plan(ref, claim)
        started = ClaimEntry(
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            state=PREPARE_STARTED,
            cdi_spec=str(files.spec),
            claim_dir=str(files.claim_dir),
        )
        self.checkpoint.put(started)
        _maybe_crash("prepare-started")
        try:
            self._remove_files(files)  # leftovers of anything earlier under these names
            devices = self._write_files(ref, plan, files)
            self.checkpoint.put(replace(started, state=PREPARE_COMPLETED, devices=devices))
        except BaseException:
            self._remove_artifacts(started)
            self.checkpoint.delete(ref.uid)
            raise
        _maybe_crash("prepare-completed")
        for d in plan.devices:
            log.info(
                "claim %s: prepared device %s (GPU %s %s): memory %d bytes, SM %d%%, policy %s",
                ref,
                d.device,
                d.gpu.index,
                d.gpu.uuid,
                d.memory_limit,
                d.sm_limit,
                d.config.compute_policy,
            )
        return devices

    def _repair(
        self, ref: ClaimRef, claim: dict[str, Any], entry: ClaimEntry
    ) -> tuple[PreparedDevice, ...]:
        """Recreate the missing files of a prepared claim. Existing ones (the shared directory
        with the slice's usage, the demand record) are kept; on failure nothing is rolled back,
        the entry stays, and the claim fails with the reason (unprepare still cleans up)."""
        try:
            devices = self._write_files(ref, self._plan(ref, claim), self.files(ref.uid))
        except ClaimError as e:
            raise ClaimError(
                f"prepared earlier, but recreating its missing files failed: {e}"
            ) from e
        self.checkpoint.put(replace(entry, devices=devices))
        log.info("claim %s: recreated its missing files", ref)
        return devices

    def _write_files(
        self, ref: ClaimRef, plan: ClaimPlan, files: ClaimFiles
    ) -> tuple[PreparedDevice, ...]:
        """Create (or complete) the claim's files; existing ones are kept, except the limits
        file and the spec, which are rewritten atomically. Returns the answer's devices."""
        for d in (self.paths.claims_dir, self.paths.node_state_dir):
            d.mkdir(mode=0o755, parents=True, exist_ok=True)  # gone since start (an operator?)
        with hostfs.open_dir(self.paths.claims_dir) as cfd:
            hostfs.make_dir(cfd, ref.uid, 0o755)
        atomic_write(files.limits, self.render_limits(plan).encode(), mode=0o444)
        with hostfs.open_dir(files.claim_dir) as dfd:
            # root's: the tenant gets the accounting file alone (a single-file bind mount), so
            # it can neither add files here nor rename or replace the file
            hostfs.make_dir(dfd, SHARED_DIR, 0o755)
        with hostfs.open_dir(files.shared) as sfd:
            if not hostfs.is_regular(sfd, ACCOUNTING_FILE):
                # an existing file is the slice's usage: kept
                hostfs.remove(files.accounting, files.shared)  # not a file of ours
                self._create_accounting(files.accounting)
        with hostfs.open_dir(self.paths.node_state_dir) as nfd:
            name = files.demand.name
            if not hostfs.is_regular(nfd, name):
                hostfs.remove(files.demand, self.paths.node_state_dir)  # not a file of ours
                hostfs.create_empty(nfd, name, 0o666)
            os.fsync(nfd)
        _maybe_crash("prepare-dir")
        inj = self._injection(plan)
        spec = self.build_spec(plan, files.claim_dir, inj)
        self.writer.write(spec, ref.uid)
        _maybe_crash("prepare-cdi")
        cdi_id = spec.qualified_name(ref.uid)
        return tuple(
            PreparedDevice(
                request_names=(d.request,),
                pool_name=d.pool,
                device_name=d.device,
                cdi_device_ids=(cdi_id, *inj.cdi_ids),
                share_id=d.share_id,
            )
            for d in plan.devices
        )

    @staticmethod
    def _create_accounting(path: Path) -> None:
        """Create the slice's accounting file (usage only, shared by the slice's processes; 0666:
        they may run as any user). sharing.region.create makes it through an O_EXCL temporary
        file and link(), neither of which follows a link, in a directory it checks (root's)."""
        region.create(path, mode=0o666)

    @staticmethod
    def render_limits(plan: ClaimPlan) -> str:
        """The claim's limits file (sharing/limitsfile.py), in container device order."""
        limits = plan.gpu_limits()
        return render_limits_file(
            memory_limits=[g.memory_limit for g in limits],
            sm_limits=[g.sm_limit for g in limits],
            policy=plan.config.compute_policy,
            priority=plan.config.priority,
            shared_cache=CONTAINER_ACCOUNTING,
            node_state_dir=CONTAINER_NODE_STATE_DIR,
            demand_file=CONTAINER_DEMAND_FILE,
        )

    def _injection(self, plan: ClaimPlan) -> Injection:
        if self.injector is None:
            return NO_INJECTION
        return self.injector.for_gpus([g.gpu for g in plan.gpu_limits()])

    def build_spec(self, plan: ClaimPlan, claim_dir: Path, inj: Injection = NO_INJECTION) -> Spec:
        """The claim's CDI spec: one device named by the claim UID."""
        limits = plan.gpu_limits()
        uuids = ",".join(g.gpu.uuid for g in limits)
        env: list[tuple[str, str]] = [
            ("CUDA_VISIBLE_DEVICES", uuids),
            ("NVIDIA_VISIBLE_DEVICES", uuids),
        ]
        # Indices as the container sees them: positions in CUDA_VISIBLE_DEVICES. For tools that
        # read them; the shim takes its limits from the limits file.
        for i, g in enumerate(limits):
            env.append((f"CUDA_DEVICE_MEMORY_LIMIT_{i}", str(g.memory_limit)))
            env.append((f"CUDA_DEVICE_SM_LIMIT_{i}", str(g.sm_limit)))
        env += [
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", CONTAINER_ACCOUNTING),
            ("VGPU_COMPUTE_POLICY", plan.config.compute_policy),
            ("VGPU_PRIORITY", str(plan.config.priority)),
            ("VGPU_NODE_STATE_DIR", CONTAINER_NODE_STATE_DIR),
            ("VGPU_DEMAND_FILE", CONTAINER_DEMAND_FILE),
        ]
        uid = plan.ref.uid
        files = self.files(uid)
        mounts = (
            Mount(str(self.paths.shim_library), CONTAINER_LIB, _RO),
            Mount(str(claim_dir / LIMITS_FILE), CONTAINER_LIMITS, _RO),
            Mount(str(self.paths.preload_file), CONTAINER_PRELOAD, _RO),
            # the accounting file alone: a tenant cannot create files on the host or rename it
            Mount(str(claim_dir / SHARED_DIR / ACCOUNTING_FILE), CONTAINER_ACCOUNTING, _RW),
            Mount(str(self.paths.node_state_dir), CONTAINER_NODE_STATE_DIR, _RO),
            Mount(str(files.demand), CONTAINER_DEMAND_FILE, _RW),
        )
        nodes: list[DeviceNode] = []
        names = [f"nvidia{g.gpu.minor}" for g in limits] + ["nvidiactl", "nvidia-uvm"]
        for n in names:
            host = self.paths.dev_root / n
            if host.exists():  # no GPU (or no UVM module) on this host: nothing to expose
                nodes.append(DeviceNode(path=f"/dev/{n}", host_path=str(host)))
        edits = ContainerEdits(env=tuple(env), device_nodes=tuple(nodes), mounts=mounts)
        edits = apply_injection(edits, inj)
        return Spec(kind=self.kind, devices=(Device(name=uid, edits=edits),))

    # --- unprepare ---------------------------------------------------------------------------

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Unprepare each claim; returns uid -> error ("" on success). Unknown claims succeed.
        The claims' directories are removed after the lock is released (see the module doc)."""
        out: dict[str, str] = {}
        with self._lock:
            for ref in claims:
                try:
                    self._unprepare_one(ref)
                    out[ref.uid] = ""
                except ClaimError as e:
                    log.warning("claim %s: unprepare failed: %s", ref, e)
                    out[ref.uid] = str(e)
                except Exception as e:
                    log.exception("claim %s: unprepare failed", ref)
                    out[ref.uid] = f"unprepare failed: {e}"
            trash, self._trash = self._trash, []  # these claims' directories: removed below
        self._remover.put(trash)
        return out

    def _unprepare_one(self, ref: ClaimRef) -> None:
        if err := uid_error(ref.uid):
            raise ClaimError(err)
        entry = self.checkpoint.get(ref.uid)
        if entry is None:
            # Not ours (or already done); names are deterministic, so sweep them anyway.
            self._remove_files(self.files(ref.uid))
            log.debug("claim %s: unprepare of an unknown claim: nothing to do", ref)
            return
        if entry.state != UNPREPARE_STARTED:
            # Recorded before anything goes: a crash from here on is finished at the next start,
            # never mistaken for a prepared claim whose files are gone.
            entry = replace(entry, state=UNPREPARE_STARTED)
            self.checkpoint.put(entry)
            _maybe_crash("unprepare-started")
        self._remove_artifacts(entry, crash_hooks=True)
        self.checkpoint.delete(ref.uid)
        log.info("claim %s: unprepared", ref)

    def _remove_artifacts(self, entry: ClaimEntry, crash_hooks: bool = False) -> None:
        """Remove the files of a checkpointed claim. They are found from its UID; a recorded
        path that differs (a checkpoint from another --cdi-root/--data-dir, or a forged one) is
        logged and left alone: the plugin deletes only inside its own directories."""
        files = self.files(entry.uid)
        for recorded, expected in (
            (entry.cdi_spec, files.spec),
            (entry.claim_dir, files.claim_dir),
        ):
            if Path(recorded) != expected:
                log.error(
                    "claim %s: the checkpoint names %s where the plugin keeps %s; not deleting "
                    "it (only files inside the plugin's own directories are deleted)",
                    entry.uid,
                    recorded,
                    expected,
                )
        self._remove_files(files, crash_hooks)

    def _remove_files(self, files: ClaimFiles, crash_hooks: bool = False) -> None:
        hostfs.remove(files.spec, self.writer.cdi_root)
        if crash_hooks:
            _maybe_crash("unprepare-cdi")
        self._move_to_trash(files.claim_dir)  # removed after the lock, by the remover
        hostfs.remove(files.demand, self.paths.node_state_dir)
        if crash_hooks:
            _maybe_crash("unprepare-dir")

    def prepared(self) -> list[ClaimEntry]:
        with self._lock:
            return self.checkpoint.entries()


class _TrashRemover:
    """One thread that removes the trash entries it is given, in order, outside every lock of
    the plugin (started at the first entry). An entry that cannot be removed is one log line and
    stays for the next start."""

    def __init__(self, trash: Path) -> None:
        self.trash = trash
        self._queue: queue.Queue[str] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def put(self, names: list[str]) -> None:
        if not names:
            return
        for name in names:
            self._queue.put(name)
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trash", daemon=True)
                self._thread.start()

    def idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _run(self) -> None:
        while True:
            name = self._queue.get()
            try:
                hostfs.remove(self.trash / name, self.trash)
            except Exception as e:
                log.error("cannot remove %s: %s; left for the next start", self.trash / name, e)
            finally:
                self._queue.task_done()


def _is_regular(path: Path) -> bool:
    try:
        with hostfs.open_dir(path.parent) as dfd:
            return hostfs.is_regular(dfd, path.name)
    except FileNotFoundError:
        return False

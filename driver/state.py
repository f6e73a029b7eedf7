"""Prepare and unprepare of claims on this node: the DeviceState.

Prepare of one claim:
  1. a PrepareCompleted checkpoint entry -> return its recorded answer (no API call);
  2. read the ResourceClaim, check it and compute the limits (driver/claims.py);
  3. checkpoint PrepareStarted with the paths about to be created;
  4. create the claim's accounting directory and file (sharing.region), write its CDI spec;
  5. checkpoint PrepareCompleted with the answer, return it.
A failure after 3 removes what was created and the entry; a crash after 3 is rolled back at the
next start (recover()). Either way no CDI spec or directory is left without an entry.

One claim = one CDI device `k8s.<driver>/claim=<claim-uid>` carrying every GPU of the claim, and
one accounting directory: all containers of a pod that use the claim share one quota; two claims
never share a directory, even on the same GPU.

Test hook: VGPU_TEST_CRASH_AT=<step> makes the process SIGKILL itself at that step (steps:
CRASH_STEPS). It is read from the environment on each call; production never sets it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cdi.spec import ContainerEdits, Device, DeviceNode, Mount, Spec
from cdi.writer import SpecWriter, fsync_dir
from driver.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimEntry,
    PreparedDevice,
)
from driver.claims import ClaimError, ClaimPlan, ClaimRef, RulesFor, plan_claim, read_claim
from driver.injection import NO_INJECTION, DriverInjector, Injection
from driver.injection import apply as apply_injection
from sharing import region
from sharing.gpus import GpuInfo

log = logging.getLogger(__name__)

CRASH_ENV = "VGPU_TEST_CRASH_AT"
CRASH_STEPS = (
    "prepare-started",  # after the PrepareStarted checkpoint
    "prepare-dir",  # after the accounting directory exists
    "prepare-cdi",  # after the CDI spec is written
    "prepare-completed",  # after the PrepareCompleted checkpoint, before answering
    "unprepare-cdi",  # after the CDI spec is removed
    "unprepare-dir",  # after the directory is removed, before the entry is dropped
)

# Where things appear inside the container.
CONTAINER_LIB = "/usr/local/lib/vgpu-sharing/libvgpu.so"
CONTAINER_PRELOAD = "/etc/ld.so.preload"
CONTAINER_CLAIM_DIR = "/run/vgpu-sharing"
# Node-wide demand files of the compute controller (docs/compute.md): one host directory shared
# by every slice's containers, so that elastic slices find idle SMs. Its container path.
NODE_STATE_DIR = "/var/run/vgpu/node-state"
ACCOUNTING_FILE = "accounting"
CLAIM_CLASS = "claim"

_UID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9\-]*$")

ClaimReader = Callable[[ClaimRef], dict[str, Any]]


def _maybe_crash(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        log.warning("test hook %s=%s: killing this process", CRASH_ENV, step)
        os.kill(os.getpid(), signal.SIGKILL)


def cdi_kind(driver_name: str) -> str:
    return f"k8s.{driver_name}/{CLAIM_CLASS}"


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
    node_state_dir: Path  # <data dir>/node-state, shared by every slice of the node
    dev_root: Path = Path("/dev")


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

    def set_gpus(self, gpus: Sequence[GpuInfo]) -> None:
        """Plan later claims on these GPUs (rediscovery saw GPUs appear or go). Prepared claims
        keep their specs; device names map to GPUs by index, so a GPU at a reused index is the
        new one."""
        with self._lock:
            self.gpus = list(gpus)

    @staticmethod
    def api_reader(api_client: Any) -> ClaimReader:
        return lambda ref: read_claim(api_client, ref)

    # --- startup -----------------------------------------------------------------------------

    def recover(self) -> None:
        """Load the checkpoint, roll back interrupted prepares, remove orphans.

        Raises CheckpointError when the checkpoint is corrupt (never silently starts empty).
        """
        with self._lock:
            self.checkpoint.load()
            for entry in self.checkpoint.entries():
                if entry.state == PREPARE_STARTED:
                    log.warning(
                        "claim %s/%s (%s): rolling back a prepare interrupted by a restart",
                        entry.namespace,
                        entry.name,
                        entry.uid,
                    )
                    self._remove_artifacts(entry.uid, Path(entry.cdi_spec), Path(entry.claim_dir))
                    self.checkpoint.delete(entry.uid)
            self._remove_orphans()
            log.info("checkpoint %s: %d prepared claims", self.checkpoint.path,
                     len(self.checkpoint.entries()))  # fmt: skip

    def _remove_orphans(self) -> None:
        """Specs and directories of ours that no checkpoint entry owns (defence in depth)."""
        known = {e.uid for e in self.checkpoint.entries()}
        prefix = f"{self.kind.replace('/', '-')}_"
        root = self.writer.cdi_root
        if root.is_dir():
            for p in root.glob(f"{prefix}*.json"):
                uid = p.name[len(prefix) : -len(".json")]
                if uid not in known:
                    log.warning("removing orphan CDI spec %s", p)
                    p.unlink(missing_ok=True)
        if self.paths.claims_dir.is_dir():
            for d in self.paths.claims_dir.iterdir():
                if d.name not in known:
                    log.warning("removing orphan claim directory %s", d)
                    shutil.rmtree(d, ignore_errors=True)

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
        return out

    def _completed(self, ref: ClaimRef) -> tuple[PreparedDevice, ...] | None:
        """The recorded answer of a completed prepare (call with the lock held)."""
        entry = self.checkpoint.get(ref.uid)
        if entry is not None and entry.state == PREPARE_COMPLETED:
            log.debug("claim %s: already prepared", ref)
            return entry.devices
        return None

    def _prepare_one(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        if not _UID_RE.match(ref.uid):
            raise ClaimError(f"claim UID {ref.uid!r} invalid; allowed: letters, digits and '-'")
        with self._lock:
            done = self._completed(ref)
        if done is not None:
            return done
        # The API read is the slow part: outside the lock, so that one slow claim does not hold
        # up prepares and unprepares of other pods.
        claim = self._read(ref)
        with self._lock:
            done = self._completed(ref)  # a concurrent call for the same claim got there first
            if done is not None:
                return done
            return self._create(ref, claim)

    def _create(self, ref: ClaimRef, claim: dict[str, Any]) -> tuple[PreparedDevice, ...]:
        entry = self.checkpoint.get(ref.uid)
        if entry is not None:  # a PrepareStarted left by a failure: start over cleanly
            self._remove_artifacts(ref.uid, Path(entry.cdi_spec), Path(entry.claim_dir))
            self.checkpoint.delete(ref.uid)
        plan = plan_claim(
            claim,
            ref,
            driver_name=self.driver_name,
            node_name=self.node_name,
            gpus=self.gpus,
            mode=self.mode,
            partitions=self.partitions,
            rules_for=self.rules_for,
        )
        spec_path = self.writer.path_for(self.kind, ref.uid)
        claim_dir = self.paths.claims_dir / ref.uid
        started = ClaimEntry(
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            state=PREPARE_STARTED,
            cdi_spec=str(spec_path),
            claim_dir=str(claim_dir),
        )
        self.checkpoint.put(started)
        _maybe_crash("prepare-started")
        try:
            self._make_claim_dir(claim_dir)
            # The accounting file, made now with the limits so that the first process of the
            # slice does not have to (and a later reader sees the quota before any CUDA call).
            limits = {i: g.memory_limit for i, g in enumerate(plan.gpu_limits())}
            region.create(claim_dir / ACCOUNTING_FILE, limits, mode=0o666)
            _maybe_crash("prepare-dir")
            inj = self._injection(plan)
            spec = self.build_spec(plan, claim_dir, inj)
            self.writer.write(spec, ref.uid)
            _maybe_crash("prepare-cdi")
            cdi_id = spec.qualified_name(ref.uid)
            devices = tuple(
                PreparedDevice(
                    request_names=(d.request,),
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=(cdi_id, *inj.cdi_ids),
                    share_id=d.share_id,
                )
                for d in plan.devices
            )
            self.checkpoint.put(replace(started, state=PREPARE_COMPLETED, devices=devices))
        except BaseException:
            self._remove_artifacts(ref.uid, spec_path, claim_dir)
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

    def _make_claim_dir(self, claim_dir: Path) -> None:
        claim_dir.mkdir(parents=True, exist_ok=True)
        # Containers may run as any non-root user; the shim creates the accounting file there.
        # Sticky so one container user cannot delete a file another user's process created.
        os.chmod(claim_dir, 0o1777)
        fsync_dir(claim_dir.parent)

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
        # Indices as the container sees them: positions in CUDA_VISIBLE_DEVICES.
        for i, g in enumerate(limits):
            env.append((f"CUDA_DEVICE_MEMORY_LIMIT_{i}", str(g.memory_limit)))
            env.append((f"CUDA_DEVICE_SM_LIMIT_{i}", str(g.sm_limit)))
        env += [
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", f"{CONTAINER_CLAIM_DIR}/{ACCOUNTING_FILE}"),
            ("VGPU_COMPUTE_POLICY", plan.config.compute_policy),
            ("VGPU_PRIORITY", str(plan.config.priority)),
            ("VGPU_NODE_STATE_DIR", NODE_STATE_DIR),
        ]
        ro = ("ro", "nosuid", "nodev", "bind")
        mounts = (
            Mount(str(self.paths.shim_library), CONTAINER_LIB, ro),
            Mount(str(self.paths.preload_file), CONTAINER_PRELOAD, ro),
            Mount(str(claim_dir), CONTAINER_CLAIM_DIR, ("rw", "nosuid", "nodev", "bind")),
            Mount(
                str(self.paths.node_state_dir), NODE_STATE_DIR, ("rw", "nosuid", "nodev", "bind")
            ),
        )
        nodes: list[DeviceNode] = []
        names = [f"nvidia{g.gpu.minor}" for g in limits] + ["nvidiactl", "nvidia-uvm"]
        for n in names:
            host = self.paths.dev_root / n
            if host.exists():  # no GPU (or no UVM module) on this host: nothing to expose
                nodes.append(DeviceNode(path=f"/dev/{n}", host_path=str(host)))
        edits = ContainerEdits(env=tuple(env), device_nodes=tuple(nodes), mounts=mounts)
        edits = apply_injection(edits, inj)
        return Spec(kind=self.kind, devices=(Device(name=plan.ref.uid, edits=edits),))

    # --- unprepare ---------------------------------------------------------------------------

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Unprepare each claim; returns uid -> error ("" on success). Unknown claims succeed."""
        out: dict[str, str] = {}
        with self._lock:
            for ref in claims:
                try:
                    self._unprepare_one(ref)
                    out[ref.uid] = ""
                except Exception as e:
                    log.exception("claim %s: unprepare failed", ref)
                    out[ref.uid] = f"unprepare failed: {e}"
        return out

    def _unprepare_one(self, ref: ClaimRef) -> None:
        if not _UID_RE.match(ref.uid):
            raise ClaimError(f"claim UID {ref.uid!r} invalid; allowed: letters, digits and '-'")
        entry = self.checkpoint.get(ref.uid)
        if entry is None:
            # Not ours (or already done); names are deterministic, so sweep them anyway.
            self._remove_artifacts(
                ref.uid, self.writer.path_for(self.kind, ref.uid), self.paths.claims_dir / ref.uid
            )
            log.debug("claim %s: unprepare of an unknown claim: nothing to do", ref)
            return
        self._remove_artifacts(ref.uid, Path(entry.cdi_spec), Path(entry.claim_dir))
        self.checkpoint.delete(ref.uid)
        log.info("claim %s: unprepared", ref)

    def _remove_artifacts(self, uid: str, spec_path: Path, claim_dir: Path) -> None:
        if spec_path.exists():
            spec_path.unlink(missing_ok=True)
            fsync_dir(spec_path.parent)
        _maybe_crash("unprepare-cdi")
        if claim_dir.exists():
            shutil.rmtree(claim_dir)
            fsync_dir(claim_dir.parent)
        _maybe_crash("unprepare-dir")

    def prepared(self) -> list[ClaimEntry]:
        with self._lock:
            return self.checkpoint.entries()

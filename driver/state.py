"""Prepare and unprepare of claims on this node: the DeviceState, the checkpointed state machine.

A claim's files and paths are driver/claimfiles.py's; its limits file text is
driver/claimlimits.py's, its device metadata files driver/devicemetadata.py's and its CDI spec
driver/claimspec.py's; removed claim directories go
through driver/trash.py, and what no checkpoint entry owns is swept by driver/orphans.py.

Prepare of one claim:
  1. a PrepareCompleted checkpoint entry whose files all exist -> return its recorded answer (no
     API call). If one is missing (e.g. /var/run/cdi is a tmpfs and the node rebooted), the
     claim is read again and the missing files are recreated; an existing shared/ directory
     (the slice's usage) is kept;
  2. read the ResourceClaim, check it and compute the limits (driver/claims.py);
  3. checkpoint PrepareStarted; its request leaves the burst pool, and what bursting claims
     borrow above their new grants is taken back (driver/reclaim.py, docs/policy.md): the
     reclaim is recorded and noticed under the lock, waited for without it;
  4. create the claim directory, limits file, shared directory, accounting file, demand file,
     device metadata files (attributes from this node's ResourceSlices); write the CDI spec;
  5. checkpoint PrepareCompleted with the answer, return it.
A failure after 3 removes what was created and the entry; a crash after 3 is rolled back at the
next start (recover()). Unprepare checkpoints UnprepareStarted before removing anything, so a
crash half-way is finished at the next start, never taken for a prepared claim.

One claim = one CDI device `k8s.<driver>/claim=<claim-uid>` carrying every GPU of the claim, and
one accounting directory: all containers of a pod that use the claim share one quota; two claims
never share a directory, even on the same GPU.

Crash points for tests: driver/crashpoints.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cdi.writer import SpecWriter
from driver import burst, hostfs, reclaim
from driver.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    UNPREPARE_STARTED,
    Checkpoint,
    ClaimEntry,
    ClaimMemory,
    PreparedDevice,
)
from driver.claimfiles import (
    ClaimFiles,
    HostPaths,
    cdi_kind,
    uid_error,
    write_claim_dir,
    write_metadata,
)
from driver.claimlimits import render_limits
from driver.claims import ClaimError, ClaimPlan, ClaimRef, RulesFor, plan_claim, read_claim
from driver.claimspec import build_spec
from driver.contextsize import ContextSizes
from driver.crashpoints import maybe_crash
from driver.devicemetadata import Attributes, MetadataFile, metadata_files, metadata_requests
from driver.injection import NO_INJECTION, DriverInjector, Injection
from driver.opmetrics import BurstReading
from driver.orphans import remove_orphans
from driver.trash import Trash
from sharing.claimlayout import demand_name
from sharing.gpus import GpuInfo
from sharing.policy import BUILTIN
from sharing.quantity import format_bytes

log = logging.getLogger(__name__)

ClaimReader = Callable[[ClaimRef], dict[str, Any]]
# (namespace, name, uid, reason, message): an Event on a ResourceClaim (driver/events.py)
ClaimEvent = Callable[[str, str, str, str, str], None]
RECLAIM_OUTCOMES = ("freed", "evicted", "timeout")


@dataclass
class ReclaimStats:
    """What the burst reclaims did since the start (the plugin's metrics)."""

    outcomes: dict[str, int]
    seconds: list[float]  # from the prepare that needed the memory to the memory being free

    @staticmethod
    def new() -> ReclaimStats:
        return ReclaimStats(dict.fromkeys(RECLAIM_OUTCOMES, 0), [])


@dataclass
class _Owed:
    """A borrower a reclaim waits for, under its own GPU's policy."""

    borrower: reclaim.Borrower  # its grant as the checkpoint now gives it
    policy: str  # evict | wait
    span: float  # the policy's grace or timeout (seconds)
    deadline: float  # time.monotonic()
    deadline_ns: int  # the same in unix ns (the pool file's and the checkpoint's clock)
    stopped: bool = False  # `evict` after the grace: its processes were stopped


@dataclass
class _Reclaim:
    """Borrowed memory a prepare takes back before it answers."""

    entry: ClaimEntry  # the claim that needs it (PrepareStarted, with the reclaim's record)
    owed: list[_Owed]
    t0: float

    @property
    def need(self) -> dict[int, int]:
        """GPU -> the new claim's request there."""
        return {m.gpu: m.request for m in self.entry.memory or ()}

    def states(self) -> dict[tuple[str, int], int]:
        """The pool entries' RECLAIM deadlines (0: `wait`, no deadline)."""
        return {(o.borrower.uid, o.borrower.gpu): o.deadline_ns if o.policy == "evict" else 0
                for o in self.owed}  # fmt: skip


UNPREPARED_WHILE_WAITING = (
    "unprepared while its prepare waited for borrowed memory (burst reclaim); nothing was prepared"
)


def _record(owed: Sequence[_Owed]) -> dict[str, Any]:
    """The checkpoint's record of a reclaim: each borrower with its policy and deadline."""
    return {
        "policy": "evict" if any(o.policy == "evict" for o in owed) else "wait",
        "deadline_unix_ns": max(o.deadline_ns for o in owed),
        "borrowers": [[o.borrower.uid, o.borrower.gpu, o.policy, o.deadline_ns] for o in owed],
    }


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class DeviceState:
    """Prepared claims of this node. Thread-safe: changes to files and checkpoint are serialised
    by one lock; reading claims from the API server and waiting for a burst reclaim happen
    outside it."""

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
        context_sizes: ContextSizes | None = None,
        on_prepared: Callable[[ClaimPlan], None] | None = None,
        on_unprepared: Callable[[ClaimRef], None] | None = None,
        published: Callable[[], Attributes] | None = None,
        on_event: ClaimEvent | None = None,
        nvml: reclaim.NvmlRead | None = None,
    ) -> None:
        """on_prepared: told of every claim whose files were (re)written, e.g. to write its
        device status (driver/claimstatus.py); it must not block. on_unprepared: told of every
        claim of ours that was unprepared (to remove that status); it must not block. published: this node's
        devices' attributes as its ResourceSlices publish them, for the device metadata files
        (driver/devicemetadata.py; None: limits only). nvml: one fresh pass of the host's NVML
        (sharing/observe/nvml_reader.read_nvml), the ground truth a burst reclaim measures what a
        borrower holds by besides its accounting file (None: the accounting file alone)."""
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
        self.context_sizes = context_sizes  # VGPU_CONTEXT_SIZE_<i> (driver/contextsize.py)
        self._lock = threading.Lock()
        self._trash = Trash(paths.claims_dir, paths.trash_dir)
        self._on_prepared = on_prepared
        self._on_unprepared = on_unprepared
        self._published = published
        self.pool = burst.PoolFile(paths.burst_pool)
        builtin = replace(BUILTIN, partitions=partitions)
        self._rules_of = rules_for or (lambda _gpu: builtin)
        self._on_event = on_event
        self._nvml = nvml
        self.reclaims = ReclaimStats.new()
        # new claim's uid -> the borrowers its prepare's reclaim waits for (the pool's RECLAIM
        # entries, _reclaim_states); also what tells a second prepare of that claim to wait
        self._reclaiming: dict[str, dict[tuple[str, int], int]] = {}

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
            self.pool.open()
            pending = self._interrupted_reclaims()
        self._finish_reclaims(pending)  # waits out deadlines: without the lock
        with self._lock:
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
            remove_orphans(
                {e.uid for e in self.checkpoint.entries()},
                kind=self.kind,
                cdi_root=self.writer.cdi_root,
                checkpoint_path=self.checkpoint.path,
                paths=self.paths,
                trash=self._trash,
            )
            self._apply_pool(full=True)  # the file's grants recomputed from the prepared claims
            log.info("checkpoint %s: %d prepared claims", self.checkpoint.path,
                     len(self.checkpoint.entries()))  # fmt: skip
            self._trash.take()
            leftovers = self._trash.listing()  # this start's moves and what a crash left
        self._trash.remove_later(leftovers)

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

    # --- the burst pool ------------------------------------------------------------------------

    def _apply_pool(self, full: bool = False) -> burst.Grants:
        """Recompute the grants from the checkpoint and write them into the pool file, with the
        entries every reclaim in progress waits for in state RECLAIM (call with the lock held,
        after every change of the checkpoint's set of claims)."""
        entries = self.checkpoint.entries()
        grants = burst.compute(entries, self.gpus, self._rules_of)
        if not self.pool.is_open:
            self.pool.open()
            full = True
        self.pool.apply(entries, grants, reclaims=self._reclaim_states(), full=full)
        return grants

    def _reclaim_states(self) -> dict[tuple[str, int], int]:
        """(uid, GPU) -> deadline (unix ns; 0 under `wait`) of each borrower a reclaim in
        progress waits for; one two reclaims wait for keeps the earlier `evict` deadline."""
        out: dict[tuple[str, int], int] = {}
        for owed in self._reclaiming.values():
            for key, ns in owed.items():
                cur = out.get(key)
                if cur is None or (ns != 0 and (cur == 0 or ns < cur)):
                    out[key] = ns
        return out

    def _borrowers(self, entry: ClaimEntry, grants: burst.Grants) -> list[reclaim.Borrower]:
        """The bursting claims on entry's GPUs that borrow more than their (new) grant, newest
        claim first. The grants are already in the pool file: read after it (the protocol's
        fence: docs/policy.md), their usage shows any allocation charged before the write."""
        gpus = {m.gpu for m in entry.memory or ()}
        others = [e for e in self.checkpoint.entries() if e.uid != entry.uid]
        bursting = [b for b in self._bursting(others, grants) if b.gpu in gpus]
        reading = reclaim.one_reading(bursting)
        return [b for b in bursting if not b.fits(reading)]

    def _bursting(
        self, entries: Sequence[ClaimEntry], grants: burst.Grants
    ) -> list[reclaim.Borrower]:
        """Every (claim, GPU) of entries that may burst, with its grant, newest claim first."""
        uuids = {g.index: g.uuid for g in self.gpus}
        return [
            reclaim.Borrower(
                uid=e.uid, namespace=e.namespace, name=e.name, gpu=m.gpu,
                container_index=i, request=m.request,
                grant=grants.grants.get((e.uid, m.gpu), 0),
                accounting=self.files(e.uid).accounting,
                uuid=uuids.get(m.gpu, ""), nvml=self._nvml,
            )
            for e in sorted(entries, key=lambda x: (x.seq, x.uid), reverse=True)
            for i, m in enumerate(e.memory or ())
            if m.bursts
        ]  # fmt: skip

    def _begin_reclaim(self, entry: ClaimEntry, grants: burst.Grants) -> _Reclaim | None:
        """The new claim's request has left the pool (grants written): record a reclaim of what
        borrowers hold above their new grants, each under its own GPU's policy, mark their
        entries RECLAIM and send `evict`'s notices. None when nobody borrows too much. Call with
        the lock held; the waiting is _settle's, without it."""
        borrowers = self._borrowers(entry, grants)
        if not borrowers:
            return None
        t0, now_ns = time.monotonic(), time.time_ns()
        owed = []
        for b in borrowers:
            gpu = next((g for g in self.gpus if g.index == b.gpu), None)
            pol = self._rules_of(gpu).burst if gpu is not None else BUILTIN.burst
            span = pol.timeout if pol.reclaim == "wait" else pol.grace
            owed.append(_Owed(b, pol.reclaim, span, t0 + span, now_ns + int(span * 1e9)))
        r = _Reclaim(replace(entry, reclaim=_record(owed)), owed, t0)
        self.checkpoint.put(r.entry)  # before any notice or stop
        self._reclaiming[entry.uid] = r.states()
        # `wait`'s entries say RECLAIM with no deadline: the watchdog then holds the borrowers
        # to their limits, not their new grants (wait stops nobody)
        self._apply_pool()
        need = r.need
        evicts = [o.borrower for o in owed if o.policy == "evict"]
        for b in evicts:
            held = b.borrowed()
            self._event(b, "BurstReclaimNotice",
                        f"claim {entry.namespace}/{entry.name} needs its request of "
                        f"{format_bytes(need.get(b.gpu, 0))} on GPU {b.gpu}: this claim borrows "
                        f"{format_bytes(held)} above its request and its grant is now "
                        f"{format_bytes(b.grant)}; free the rest before the deadline or its "
                        "processes are stopped (SIGWINCH sent; the pool file says RECLAIM)")  # fmt: skip
            pids = reclaim.notify(b)
            log.warning("burst reclaim for claim %s/%s: claim %s borrows %d bytes on GPU %d, "
                        "grant %d: notice sent to %s", entry.namespace, entry.name, b.claim,
                        held, b.gpu, b.grant, pids or "no process")  # fmt: skip
        if evicts:
            maybe_crash("reclaim-notice")
        return r

    def _settle(self, r: _Reclaim) -> None:
        """Without the lock (other prepares and unprepares go on; an unprepare of a borrower may
        be what frees the memory): wait until every borrower fits its grant as it is now, each
        `evict` borrower past its grace stopped then and there, until nobody is short or every
        one short is past its time. ClaimError when the memory is not free, or when the claim
        was unprepared meanwhile."""
        need = r.need
        stopped = False  # any `evict` borrower's processes (one unprepared since counts too)
        while True:
            with self._lock:
                mine = self._still_preparing(r.entry)
                entries = self.checkpoint.entries()
                grants = burst.compute(entries, self.gpus, self._rules_of)
            if not mine:
                raise ClaimError(UNPREPARED_WHILE_WAITING)
            present = {e.uid for e in entries}
            r.owed = [o for o in r.owed if o.borrower.uid in present]  # unprepared: holds none
            for o in r.owed:
                o.borrower = replace(
                    o.borrower, grant=grants.grants.get((o.borrower.uid, o.borrower.gpu), 0)
                )
            reading = reclaim.one_reading([o.borrower for o in r.owed])
            short = [o for o in r.owed if not o.borrower.fits(reading)]
            now = time.monotonic()
            due = [o for o in short if o.policy == "evict" and now >= o.deadline and not o.stopped]
            for o in due:
                o.stopped = stopped = True
                self._stop(r.entry, o.borrower)
            if due:
                continue  # look again now that they are stopped
            if all(now >= o.deadline for o in short):
                break
            time.sleep(reclaim.POLL)
        for o in r.owed:
            if o.policy == "evict" and not o.stopped:
                self._event(o.borrower, "BurstReclaimed",
                            f"claim {r.entry.namespace}/{r.entry.name} needed its request on GPU "
                            f"{o.borrower.gpu}: this claim gave back what it borrowed above its "
                            f"grant of {format_bytes(o.borrower.grant)} within the grace; no "
                            "process stopped")  # fmt: skip
        waits = [o for o in short if o.policy == "wait"]
        self._count("timeout" if waits else "evicted" if stopped else "freed")
        if waits:
            b, span = waits[0].borrower, waits[0].span
            taken = b.borrowed() - b.grant
            raise ClaimError(
                f"device gpu-{b.gpu}: {format_bytes(min(taken, need.get(b.gpu, 0)))} of the "
                f"{format_bytes(need.get(b.gpu, 0))} this claim's request needs are borrowed by "
                f"claim {b.claim} and were not given back within {span:g}s (burst "
                "reclaim: wait); the kubelet retries"
            )
        if short:
            b = short[0].borrower
            raise ClaimError(
                f"device gpu-{b.gpu}: claim {b.claim} still borrows "
                f"{format_bytes(b.borrowed())} above its grant of {format_bytes(b.grant)} "
                "after its processes were stopped (burst reclaim: evict); the kubelet retries"
            )

    def _stop(self, entry: ClaimEntry, b: reclaim.Borrower) -> None:
        """`evict` after the grace: stop b's processes, newest first, until it fits."""
        before = b.borrowed()
        stopped = reclaim.stop_until_fits(b)
        self._event(b, "BurstReclaimed",
                    f"claim {entry.namespace}/{entry.name} needed its request on GPU {b.gpu}: "
                    f"{format_bytes(max(0, before - b.borrowed()))} taken back from this "
                    f"claim (grant now {format_bytes(b.grant)}); processes stopped: "
                    f"{', '.join(map(str, stopped)) or 'none'}")  # fmt: skip

    def _still_preparing(self, entry: ClaimEntry) -> bool:
        """Is entry's prepare still the checkpoint's (not unprepared meanwhile)?"""
        cur = self.checkpoint.get(entry.uid)
        return cur is not None and cur.state == PREPARE_STARTED and cur.seq == entry.seq

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.reclaims.outcomes[outcome] += 1

    def _end_reclaim(self, r: _Reclaim) -> None:
        """The reclaim is over, whatever its outcome (call with the lock held)."""
        self._reclaiming.pop(r.entry.uid, None)
        self.reclaims.seconds.append(time.monotonic() - r.t0)

    def _interrupted_reclaims(self) -> list[_Reclaim]:
        """At start (the lock held, nothing served yet): the `evict` reclaims a killed plugin
        left in its checkpoint, their entries RECLAIM again with their absolute deadlines. The
        grants are written low first (the claim that needed the memory still counts). Their
        claims are rolled back afterwards like any interrupted prepare; `wait` needs nothing
        more (its claim's rollback returns the memory)."""
        out = []
        grants = burst.compute(self.checkpoint.entries(), self.gpus, self._rules_of)
        for e in self.checkpoint.entries():
            if e.reclaim is None:
                continue
            log.warning("claim %s/%s (%s): finishing a burst reclaim (%s) a restart interrupted",
                        e.namespace, e.name, e.uid, e.reclaim["policy"])  # fmt: skip
            now, now_ns = time.monotonic(), time.time_ns()
            wanted = {(u, g): (pol, ns) for u, g, pol, ns in e.reclaim["borrowers"]}
            owed = []
            for b in self._borrowers(e, grants):
                pol, ns = wanted.get((b.uid, b.gpu), ("", 0))
                if pol == "evict":
                    left = max(0.0, (ns - now_ns) / 1e9)
                    owed.append(_Owed(b, pol, left, now + left, ns))
            if owed:
                r = _Reclaim(e, owed, now)
                self._reclaiming[e.uid] = r.states()
                out.append(r)
        self._apply_pool(full=True)
        return out

    def _finish_reclaims(self, pending: Sequence[_Reclaim]) -> None:
        """At start, without the lock: wait out each interrupted evict's deadline and stop what
        still borrows."""
        for r in pending:
            try:
                self._settle(r)
            except ClaimError as err:  # the claim is rolled back; its retried prepare decides
                log.error("claim %s/%s (%s): %s", r.entry.namespace, r.entry.name, r.entry.uid,
                          err)  # fmt: skip
            finally:
                with self._lock:
                    self._end_reclaim(r)

    def _event(self, b: reclaim.Borrower, reason: str, message: str) -> None:
        if self._on_event is not None:
            self._on_event(b.namespace, b.name, b.uid, reason, message)

    def burst_reading(self) -> BurstReading:
        """The burst pool's numbers for the metrics: each bursting claim's borrowed bytes (the
        larger of its accounting file's and the host NVML's measure) and grant per GPU, each
        GPU's pool, the reclaims' outcomes and durations."""
        with self._lock:
            entries = self.checkpoint.entries()
            grants = burst.compute(entries, self.gpus, self._rules_of)
            outcomes = dict(self.reclaims.outcomes)
            seconds = list(self.reclaims.seconds)
        bursting = self._bursting(entries, grants)
        reading = reclaim.one_reading(bursting)  # measured as a reclaim measures them
        slices = [(b.claim, b.gpu, b.borrowed(reading), b.grant) for b in bursting]
        pools = {i: d.pool for i, d in grants.devices.items()}
        return BurstReading(slices, pools, outcomes, seconds)

    def grants(self) -> burst.Grants:
        """The grants as the checkpoint gives them now (tests, metrics)."""
        with self._lock:
            return burst.compute(self.checkpoint.entries(), self.gpus, self._rules_of)

    def trash_idle(self, timeout: float) -> bool:
        """Wait until every queued removal is done (tests; False on timeout)."""
        return self._trash.idle(timeout)

    def _take_trash(self) -> list[str]:
        with self._lock:
            return self._trash.take()

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
        self._trash.remove_later(self._take_trash())  # leftovers under these claims' names
        return out

    def _completed(self, ref: ClaimRef) -> tuple[tuple[PreparedDevice, ...] | None, list[str]]:
        """The recorded answer of a completed prepare whose files all exist, else None and the
        missing files (call with the lock held)."""
        entry = self.checkpoint.get(ref.uid)
        if entry is None or entry.state != PREPARE_COMPLETED:
            return None, []
        requests = metadata_requests(
            entry.name, (r for d in entry.devices for r in d.request_names)
        )
        missing = self.files(ref.uid).missing(requests)
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
            attrs = self._published_attributes()
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
            if ref.uid in self._reclaiming:
                raise ClaimError(
                    "an earlier prepare of this claim is still waiting for borrowed memory "
                    "(burst reclaim); the kubelet retries"
                )
            entry = self.checkpoint.get(ref.uid)
            if entry is not None and entry.state == PREPARE_COMPLETED:
                return self._repair(ref, claim, entry, attrs)
            started, plan, pending = self._start(ref, claim)
            if pending is None:
                return self._complete(ref, claim, attrs, started, plan)
        # Borrowed memory is being taken back: waited for without the lock, so that other
        # claims' prepares and unprepares (one may free the memory) are not held up by it.
        try:
            self._settle(pending)
        except BaseException:
            with self._lock:
                self._end_reclaim(pending)
                self._roll_back(pending.entry)
            raise
        with self._lock:
            self._end_reclaim(pending)
            if not self._still_preparing(pending.entry):
                self._apply_pool()
                raise ClaimError(UNPREPARED_WHILE_WAITING)
            return self._complete(ref, claim, attrs, started, plan)

    def _published_attributes(self) -> Attributes:
        if self._published is None:
            return {}
        try:
            return self._published()
        except Exception as e:  # the API server: the kubelet retries the prepare
            raise ClaimError(
                f"reading this node's ResourceSlices for the device metadata: {e}"
            ) from e

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

    def _start(
        self, ref: ClaimRef, claim: dict[str, Any]
    ) -> tuple[ClaimEntry, ClaimPlan, _Reclaim | None]:
        """Plan the claim, checkpoint PrepareStarted, take its request out of the pool and
        begin any reclaim it needs (call with the lock held)."""
        entry = self.checkpoint.get(ref.uid)
        if entry is not None:  # PrepareStarted left by a failure, or UnprepareStarted: start over
            self._remove_artifacts(entry)
            self.checkpoint.delete(ref.uid)
        plan = self._plan(ref, claim)
        others = self.checkpoint.entries()
        try:
            memory = burst.plan_memory(
                [(g.gpu.index, g.memory_limit, g.burst_limit) for g in plan.gpu_limits()], others
            )
        except ValueError as e:
            raise ClaimError(str(e)) from e
        started = ClaimEntry(
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            state=PREPARE_STARTED,
            cdi_spec=str(self.files(ref.uid).spec),
            claim_dir=str(self.files(ref.uid).claim_dir),
            memory=memory,
            seq=max((e.seq for e in others), default=0) + 1,
        )
        self.checkpoint.put(started)
        maybe_crash("prepare-started")
        try:
            # its request leaves the pool now: older claims' grants are cut, its own is written;
            # what borrowers hold above their new grants is taken back before prepare returns
            pending = self._begin_reclaim(started, self._apply_pool())
        except BaseException:
            self._reclaiming.pop(ref.uid, None)
            self._roll_back(started)
            raise
        return started, plan, pending

    def _complete(
        self,
        ref: ClaimRef,
        claim: dict[str, Any],
        attrs: Attributes,
        started: ClaimEntry,
        plan: ClaimPlan,
    ) -> tuple[PreparedDevice, ...]:
        """Write the claim's files and checkpoint PrepareCompleted (the lock held; its memory
        is free)."""
        files = self.files(ref.uid)
        try:
            cur = self.checkpoint.get(ref.uid)
            if cur is not None and cur.reclaim is not None:  # a reclaim ran: it is over
                self._apply_pool()  # the borrowers' entries back to OPEN
                self.checkpoint.put(started)  # without the reclaim's record
            self._remove_files(ref.uid)  # leftovers of anything earlier under these names
            meta = self._metadata(plan, claim, attrs)
            devices = self._write_files(ref, plan, files, meta, started.memory or ())
            self.checkpoint.put(replace(started, state=PREPARE_COMPLETED, devices=devices))
        except BaseException:
            self._roll_back(started)
            raise
        maybe_crash("prepare-completed")
        if self._on_prepared is not None:
            self._on_prepared(plan)
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

    def _roll_back(self, started: ClaimEntry) -> None:
        """Undo a prepare that failed, if the checkpoint's entry is still its own, and rewrite
        the pool (its request back in it, any reclaim's entries OPEN again; the lock held)."""
        if self._still_preparing(started):
            self._remove_artifacts(started)
            self.checkpoint.delete(started.uid)
        self._apply_pool()

    def _repair(
        self, ref: ClaimRef, claim: dict[str, Any], entry: ClaimEntry, attrs: Attributes
    ) -> tuple[PreparedDevice, ...]:
        """Recreate the missing files of a prepared claim. Existing ones (the shared directory
        with the slice's usage, the demand record) are kept; on failure nothing is rolled back,
        the entry stays, and the claim fails with the reason (unprepare still cleans up)."""
        try:
            plan = self._plan(ref, claim)
            meta = self._metadata(plan, claim, attrs)
            devices = self._write_files(ref, plan, self.files(ref.uid), meta, entry.memory or ())
        except ClaimError as e:
            raise ClaimError(
                f"prepared earlier, but recreating its missing files failed: {e}"
            ) from e
        self.checkpoint.put(replace(entry, devices=devices))
        if self._on_prepared is not None:
            self._on_prepared(plan)
        log.info("claim %s: recreated its missing files", ref)
        return devices

    def _metadata(
        self, plan: ClaimPlan, claim: dict[str, Any], attrs: Attributes
    ) -> list[MetadataFile]:
        return metadata_files(plan, claim.get("metadata") or {}, self.driver_name, attrs)

    def _write_files(
        self,
        ref: ClaimRef,
        plan: ClaimPlan,
        files: ClaimFiles,
        metadata: list[MetadataFile],
        memory: Sequence[ClaimMemory] = (),
    ) -> tuple[PreparedDevice, ...]:
        """Create (or complete) the claim's files; existing ones are kept, except the limits
        file, the metadata files and the spec, which are rewritten atomically. Returns the
        answer's devices."""
        limits = plan.gpu_limits()  # once per prepare: the limits file, injection and spec share it
        gpus = [g.gpu for g in limits]
        sizes = self.context_sizes.for_gpus(gpus) if self.context_sizes else []
        write_claim_dir(self.paths, ref.uid, files, render_limits(plan, limits, sizes, memory))
        write_metadata(files, {m.request: m.content for m in metadata})
        maybe_crash("prepare-dir")
        inj = self._injection(gpus, files.claim_dir)
        pool = self.paths.burst_pool if any(m.bursts for m in memory) else None
        spec = build_spec(self.kind, plan, limits, files, self.paths, inj, metadata, pool)
        self.writer.write(spec, ref.uid)
        maybe_crash("prepare-cdi")
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

    def _injection(self, gpus: Sequence[GpuInfo], claim_dir: Path) -> Injection:
        if self.injector is None:
            return NO_INJECTION
        return self.injector.for_gpus(gpus, claim_dir)

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
            trash = self._trash.take()  # these claims' directories: removed below
        self._trash.remove_later(trash)
        return out

    def _unprepare_one(self, ref: ClaimRef) -> None:
        if err := uid_error(ref.uid):
            raise ClaimError(err)
        entry = self.checkpoint.get(ref.uid)
        if entry is None:
            # Not ours (or already done); names are deterministic, so sweep them anyway.
            self._remove_files(ref.uid)
            log.debug("claim %s: unprepare of an unknown claim: nothing to do", ref)
            return
        if entry.state != UNPREPARE_STARTED:
            # Recorded before anything goes: a crash from here on is finished at the next start,
            # never mistaken for a prepared claim whose files are gone.
            entry = replace(entry, state=UNPREPARE_STARTED)
            self.checkpoint.put(entry)
            maybe_crash("unprepare-started")
        self._remove_artifacts(entry, crash_hooks=True)
        self.checkpoint.delete(ref.uid)
        self._apply_pool()  # its request returns to the pool: older grants grow again
        log.info("claim %s: unprepared", ref)
        if self._on_unprepared is not None:
            self._on_unprepared(ref)

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
        self._remove_files(entry.uid, crash_hooks)

    def _remove_files(self, uid: str, crash_hooks: bool = False) -> None:
        files = self.files(uid)
        self.writer.remove(self.kind, uid)
        if crash_hooks:
            maybe_crash("unprepare-cdi")
        self._trash.move(files.claim_dir)  # removed after the lock (driver/trash.py)
        hostfs.remove(files.demand, self.paths.node_state_dir)
        if crash_hooks:
            maybe_crash("unprepare-dir")

    def prepared(self) -> list[ClaimEntry]:
        with self._lock:
            return self.checkpoint.entries()

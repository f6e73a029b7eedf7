"""The watchdog: NVML's per-process memory (the ground truth) against the slices' quotas.

The shim enforces quotas from inside the processes; a process that does not load it (a static
binary, a cleared LD_PRELOAD, a direct ioctl user) is invisible to it. The watchdog looks from
outside, after every NVML pass:

- Attribution, by what the process cannot forge: a GPU process belongs to the slice whose
  accounting file it has mapped or open (device and inode in /proc/<pid>/maps, or a descriptor
  in /proc/<pid>/fd): a tenant cannot obtain another claim's file, which is mounted in no
  container but that claim's. A process that holds neither (the shim never initialised in it)
  is attributed by the file its environment names (CUDA_DEVICE_MEMORY_SHARED_CACHE), resolved
  strictly inside the process's root (openat2 RESOLVE_IN_ROOT: its links, absolute or "..",
  never lead out of its root to the host's files or another claim's). Nothing is taken from a
  path the host resolves. The exporter must see the host's PIDs (NVML lists them; the plugin's
  DaemonSet runs with hostPID).
- A slice is in violation on a device when NVML's memory of its processes there exceeds its
  quota plus the margin (default 128 MiB: NVML counts per-process driver memory the shim does
  not charge). A bursting claim's quota is its request plus its grant, read from the plugin's
  pool file as the shim reads it (an entry whose key is not the claim's, or that is free, grants
  0); while the plugin takes memory back from it (the entry says RECLAIM) it may hold up to its
  limit: under `wait` (no deadline) until the plugin ends the reclaim, under `evict` until
  RECLAIM_SLACK seconds past the entry's deadline (docs/policy.md, "Taking it back"). A bursting
  `vgpu run` slice, or a claim whose grant cannot be read, is held to its limit. A GPU process
  of no slice on a device that has slices is a violation too.
- A violation counts vgpu_slice_quota_violations_total once per episode (a slice that stays
  over quota is one violation until it is back under), logs one line, posts a Kubernetes Event
  on the claim (in the plugin), and with enforce="kill" stops the offending processes: SIGTERM,
  then SIGKILL after kill_grace seconds. Offenders: the slice's processes on that device that
  hold more than the shim charged them plus the margin (a process the shim never saw, or one
  that reached the driver around it: its slot in the accounting file, found by its PID in its
  own namespace, says what the shim charged); if there are none, the slice's biggest processes
  there until the rest fit.
- A process of a slice that runs without the shim (its memory map holds no libvgpu: a musl or
  static binary, a cleared LD_PRELOAD, a shim the loader refused) is reported even under its
  quota, because nothing limits it: one log line and a ShimNotLoaded Event per process, the
  gauge vgpu_slice_processes_without_shim, the plugin's /readyz body; with enforce="kill" it is
  stopped like an offender. The map is definitive: the dynamic loader maps every preloaded
  object before main, so a process that names the slice's file and has no libvgpu mapping
  never had the shim.
- For a claim of the plugin the shim must be the plugin's own copy, known by device and inode
  (<data-dir>/lib/libvgpu.so, or the previous copy still mounted in the container after an
  upgrade replaced it): any other file named libvgpu (a tenant's copy beside a limits file of
  its own, a patched build) counts as no shim. And the shim must enforce the claim's limits: it
  publishes in its slot of the accounting file where its limits come from and a hash of the
  limits file it read (vgpu/region.h); a process whose slot says the environment, or
  other limits than the claim's limits file, or that has no slot at all (it reached the driver
  without the shim ever starting) is reported and stopped the same way.
- Stopping a process checks it is still the process the pass saw (its start time in
  /proc/<pid>/stat, through a pidfd opened before the check): a PID reused meanwhile is left
  alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from sharing import burstpool, region
from sharing.claimlayout import CONTAINER_LIMITS
from sharing.logsafe import printable
from sharing.observe.nodeview import NodeView, SliceDeviceView, ViolationCounts
from sharing.observe.nvml_reader import GpuProcess, NvmlReading
from sharing.observe.procinfo import (
    Attribution,
    attribute,
    missing_shim,
    shim_limits_file,
    start_time,
)
from sharing.observe.slices import Slice, compute_policy

log = logging.getLogger(__name__)

DEFAULT_MARGIN = 128 << 20
# The compute cap from outside: a slice's processes' SM utilisation (NVML, per process) averaged
# over COMPUTE_WINDOW seconds of passes may exceed what its cap allows by COMPUTE_MARGIN points
# (the shim holds a cap to about 1 point over such a window: docs/compute.md).
COMPUTE_WINDOW = 10.0
COMPUTE_MARGIN = 10.0
ENFORCE_MODES = ("none", "kill")
# Seconds past an evict's deadline a slice whose grant entry still says RECLAIM may hold up to
# its limit: the plugin stops its processes at the deadline, one at a time, waiting up to 5 s for
# each to exit (driver/reclaim.py); the watchdog does not race it.
RECLAIM_SLACK = 10.0

# (the claim's slice, or None for a process of no slice; reason; message)
CONTAINER_LIMITS_B = CONTAINER_LIMITS.encode()

EventSink = Callable[[Slice | None, str, str], None]


@dataclass(frozen=True)
class Unshimmed:
    """A GPU process of a slice that runs without the shim, as the last pass saw it."""

    slice: Slice
    device: int
    gpu_uuid: str
    pid: int
    used_bytes: int
    why: str


def _who(sl: Slice) -> str:
    return (sl.claim_uid and f"claim {sl.namespace}/{sl.claim} ({sl.claim_uid})") or sl.claim


def _describe(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"pid {pid} ({printable(p.name())}, user {printable(p.username())})"
    except (psutil.Error, KeyError):
        return f"pid {pid}"


def _count_by_slice_device(found: list[Unshimmed]) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for u in found:
        out[(u.slice.key, u.device)] = out.get((u.slice.key, u.device), 0) + 1
    return out


def _stop(targets: list[tuple[int, int]], grace: float, proc_root: str = "/proc") -> None:
    """SIGTERM each (pid, start time), SIGKILL after `grace` seconds; through pidfds opened
    before checking the start time, so a process that exited and whose PID was reused is never
    signalled."""
    fds: dict[int, int] = {}
    for pid, start in targets:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue  # gone
        if start == 0 or start_time(pid, proc_root) != start:
            os.close(fd)
            log.warning("watchdog: pid %d is no longer the process the pass saw: not stopped", pid)
            continue
        try:
            signal.pidfd_send_signal(fd, signal.SIGTERM)
            fds[pid] = fd
        except OSError:
            os.close(fd)
    deadline = time.monotonic() + grace
    poller = select.poll()
    for fd in fds.values():
        poller.register(fd, select.POLLIN)  # readable once the process has exited
    alive = dict(fds)
    while alive and (left := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            alive = {p: f for p, f in alive.items() if f != fd}
    for pid, fd in alive.items():
        log.warning("watchdog: pid %d ignored SIGTERM for %gs; sending SIGKILL", pid, grace)
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    for fd in fds.values():
        os.close(fd)


def _number(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def fnv1a64(data: bytes) -> int:
    """The shim's hash of the limits file it read (settings.c)."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@dataclass(frozen=True)
class ClaimLimits:
    """The claim's limits file on the host: what its processes must enforce."""

    ident: tuple[int, int, int, int]  # st_dev, st_ino, st_mtime_ns, st_size
    hash: int


def _claim_limits_file(sl: Slice) -> Path | None:
    """<data-dir>/claims/<uid>/limits for a claim of the plugin; None for a --region slice."""
    if not sl.claim_uid:
        return None
    return Path(sl.region_path).parent.parent / "limits"


class Watchdog:
    def __init__(
        self,
        violations: ViolationCounts,
        *,
        enforce: str = "none",
        margin: int = DEFAULT_MARGIN,
        kill_grace: float = 5.0,
        events: EventSink | None = None,
        proc_root: str = "/proc",
        shim_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """shim_file: the plugin's installed shim (<data-dir>/lib/libvgpu.so): a claim's
        processes must map that very file. None: any libvgpu counts (`vgpu run` slices)."""
        if enforce not in ENFORCE_MODES:
            raise ValueError(f"enforce {enforce!r} unknown; allowed: {', '.join(ENFORCE_MODES)}")
        self.violations = violations
        self.enforce = enforce
        self.margin = margin
        self.kill_grace = kill_grace
        self.events = events
        self.proc_root = proc_root
        self.shim_file = shim_file
        self._shims: set[tuple[int, int]] = set()  # every identity shim_file had (this run)
        self._limits: dict[str, tuple[ClaimLimits, Path]] = {}  # claim key -> its limits file
        self._over: set[tuple[str, int]] = set()  # (slice key, device): episodes in progress
        # (slice key, device) -> the passes' (time, SM percent of its processes) in the window
        self._sm: dict[tuple[str, int], list[tuple[float, float]]] = {}
        self._sm_over: set[tuple[str, int]] = set()  # compute episodes in progress
        self._grown: set[str] = set()  # claims whose accounting file was seen grown
        self._strays: set[tuple[int, int]] = set()  # unattributed processes already counted
        self._unshimmed_seen: set[tuple[int, int]] = set()  # reported processes without shim
        self._unshimmed: tuple[Unshimmed, ...] = ()
        self._unshimmed_lock = threading.Lock()
        self._self = os.getpid()
        self._warned_blind = False
        self._warned_shim = False
        self._warned_pool: set[str] = set()  # pool files found unreadable (said once each)

    def _genuine_shims(self) -> set[tuple[int, int]] | None:
        if self.shim_file is None:
            return None
        try:
            st = os.stat(self.shim_file)
            self._shims.add((st.st_dev, st.st_ino))
        except OSError as e:
            # not installed yet (the identities seen before still count), or not ours to read
            if not self._shims and not self._warned_shim:
                self._warned_shim = True
                log.warning("watchdog: cannot read the plugin's shim %s (%s): any libvgpu "
                            "mapping counts as the shim until it can", self.shim_file, e.strerror)  # fmt: skip
        # never judge against an empty set: every process would be "without the shim"
        return self._shims or None

    def _claim_limits(self, sl: Slice) -> ClaimLimits | None:
        """The claim's limits file as it is now (re-read when it changes); None for a --region
        slice or an unreadable file (then nothing is compared)."""
        path = _claim_limits_file(sl)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._limits.get(sl.key)
            if cached is not None and cached[0].ident == ident:
                return cached[0]
            data = os.pread(fd, min(st.st_size, 1 << 16), 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        got = ClaimLimits(ident, fnv1a64(data))
        self._limits[sl.key] = (got, path)
        return got

    def check(self, view: NodeView, reading: NvmlReading) -> None:
        files = {(c.st_dev, c.st_ino): key for key, c in view.counters.items()}
        devices = {d.gpu.uuid: d for d in view.devices}
        genuine = self._genuine_shims()
        over_now: set[tuple[str, int]] = set()
        strays_now: set[tuple[int, int]] = set()
        unshimmed: list[Unshimmed] = []
        unshimmed_seen: set[tuple[int, int]] = set()
        to_stop: list[tuple[int, int]] = []
        slots: dict[str, dict[int, region.SlotLimits] | None] = {}
        seen: dict[int, Attribution] = {}  # this pass's attributions, by host PID
        now_ns = time.time_ns()
        for gpu in reading.gpus:
            dv = devices.get(gpu.uuid)
            if dv is None or not gpu.processes:
                continue
            on_dev = {s.slice.key: s for s in dv.slices}
            mine: dict[str, list[tuple[GpuProcess, Attribution]]] = {}
            for p in gpu.processes:
                if p.pid == self._self:
                    continue
                a = attribute(p.pid, self.proc_root, files)
                seen[p.pid] = a
                if not a.visible:
                    self._blind(p.pid, a.why)
                    continue
                key = files.get(a.file_id) if a.file_id else None
                if key is not None and key in on_dev:
                    mine.setdefault(key, []).append((p, a))
                elif dv.slices:
                    ident = (p.pid, a.start)
                    strays_now.add(ident)
                    if ident not in self._strays:
                        why = a.why or "its slice has no share of this GPU"
                        self._stray(gpu.uuid, p, why)
                        to_stop.append(ident)
            for key, procs in mine.items():
                s = on_dev[key]
                if key not in slots:
                    slots[key] = self._slots(s.slice)
                to_stop += self._without_shim(gpu.uuid, s, procs, unshimmed, unshimmed_seen,
                                              genuine, slots[key])  # fmt: skip
                total = sum(p.used_bytes for p, _ in procs)
                if s.memory_limit <= 0:
                    continue
                bound, what = self._memory_bound(s, now_ns)
                if total <= bound + self.margin:
                    continue
                over_now.add((key, s.device))
                if (key, s.device) not in self._over:
                    to_stop += self._over_quota(gpu.uuid, s, procs, total, view, bound, what)
        self._over = over_now
        to_stop += self._check_compute(view, reading, files, seen)
        self._cut_grown(view)
        self._strays = strays_now
        self._unshimmed_seen = unshimmed_seen
        with self._unshimmed_lock:
            self._unshimmed = tuple(unshimmed)
        self.violations.set_without_shim(_count_by_slice_device(unshimmed))
        to_stop = list(dict.fromkeys(to_stop))  # a process can be an offender twice over
        if to_stop and self.enforce == "kill":
            log.warning("watchdog: stopping pids %s (SIGTERM, SIGKILL after %gs)",
                        [pid for pid, _ in to_stop], self.kill_grace)  # fmt: skip
            threading.Thread(
                target=_stop,
                args=(to_stop, self.kill_grace, self.proc_root),
                name="watchdog-kill",
                daemon=True,
            ).start()

    def _memory_bound(self, s: SliceDeviceView, now_ns: int) -> tuple[int, str]:
        """The most the slice may hold on its device now, by NVML's count, and what that bound
        is (module docstring)."""
        if not s.memory_burst_limit:
            return s.memory_limit, "quota"
        sl, request, limit = s.slice, s.memory_limit, s.memory_burst_limit
        if not sl.burst_pool:
            return limit, "burst limit"  # `vgpu run`: its grant is its whole limit
        entry = _number(sl.limits.get(f"VGPU_BURST_GRANT_{s.device}"))
        key = _number(sl.limits.get(f"VGPU_BURST_KEY_{s.device}"))
        if entry is None or key is None or not 0 <= entry < burstpool.MAX_GRANTS:
            return limit, "burst limit"  # no grant entry named
        g = self._grant(sl.burst_pool, entry)
        if g is None:
            return limit, "burst limit"  # a writer held the entry through every try
        if g.key != key or g.state == burstpool.GRANT_FREE:
            return request, "request (no grant)"
        if g.state == burstpool.GRANT_RECLAIM and (
            g.deadline_unix_ns == 0 or now_ns < g.deadline_unix_ns + int(RECLAIM_SLACK * 1e9)
        ):
            return limit, "burst limit (a reclaim in progress)"
        grant = min(limit - request, g.grant)
        return request + grant, f"request + grant ({request} + {grant})"

    def _grant(self, path: str, entry: int) -> burstpool.Grant | None:
        """Grant entry `entry` of the pool file at path (read-only); None when the file cannot be
        read (said once per file) or a writer held the entry through every try."""
        try:
            with burstpool.Pool(path) as pool:
                g = pool.read_grant(entry)
        except (OSError, burstpool.PoolFileError) as e:
            if path not in self._warned_pool:
                self._warned_pool.add(path)
                log.warning("watchdog: burst pool file %s unreadable (%s): bursting claims are "
                            "held to their limits until it can be read", path, e)  # fmt: skip
            return None
        self._warned_pool.discard(path)
        return g

    def _check_compute(
        self,
        view: NodeView,
        reading: NvmlReading,
        files: Mapping[tuple[int, int], str],
        seen: Mapping[int, Attribution],
    ) -> list[tuple[int, int]]:
        """A slice whose processes used more of a device's SMs, over the window, than its cap
        allows (hard: the cap; elastic: the cap plus what the busy slices' caps leave idle;
        off: anything) is a violation like memory, whatever its shim says: a tenant that lifted
        its cap inside its process is seen from NVML."""
        to_stop: list[tuple[int, int]] = []
        now = reading.taken
        gpus = {g.uuid: g for g in reading.gpus}
        live: set[tuple[str, int]] = set()
        over_now: set[tuple[str, int]] = set()
        for dv in view.devices:
            gpu = gpus.get(dv.gpu.uuid)
            if gpu is None or not dv.slices or all(p.sm_util is None for p in gpu.processes):
                continue
            on_dev = {s.slice.key: s for s in dv.slices}
            procs: dict[str, list[tuple[GpuProcess, int]]] = {}
            for p in gpu.processes:
                if p.pid == self._self or not p.sm_util:
                    continue
                a = seen.get(p.pid) or attribute(p.pid, self.proc_root, files)
                key = files.get(a.file_id) if a.file_id else None
                if key is not None and key in on_dev:
                    procs.setdefault(key, []).append((p, a.start))
            used = {k: float(sum(p.sm_util or 0 for p, _ in v)) for k, v in procs.items()}
            for key, s in on_dev.items():
                ident = (key, s.device)
                live.add(ident)
                window = [x for x in self._sm.get(ident, []) if x[0] > now - COMPUTE_WINDOW]
                window.append((now, used.get(key, 0.0)))
                self._sm[ident] = window
                policy = compute_policy(s.slice)
                if policy == "off" or s.compute_limit_ratio <= 0:
                    continue
                if len(window) < 5 or window[-1][0] - window[0][0] < 0.8 * COMPUTE_WINDOW:
                    continue  # not yet a window's worth of passes
                allowed = 100.0 * s.compute_limit_ratio
                if policy == "elastic":  # idle time the busy slices' caps leave is its to take
                    busy = sum(100.0 * o.compute_limit_ratio or 100.0
                               for k, o in on_dev.items() if k != key and used.get(k))  # fmt: skip
                    allowed = max(allowed, 100.0 - busy)
                mean = sum(u for _, u in window) / len(window)
                if mean <= allowed + COMPUTE_MARGIN:
                    continue
                over_now.add(ident)
                if ident in self._sm_over:
                    continue
                self.violations.add_slice(key, s.device)
                mine = sorted(procs.get(key, []), key=lambda pa: -(pa[0].sm_util or 0))
                msg = (
                    f"{_who(s.slice)} used {mean:.0f}% of GPU {gpu.uuid}'s SMs over "
                    f"{COMPUTE_WINDOW:g} s by NVML's count, over its {policy} cap "
                    f"{allowed:.0f}% + margin {COMPUTE_MARGIN:g}: its processes "
                    f"{', '.join(_describe(p.pid) for p, _ in mine) or 'none now'}"
                )
                self._report(s.slice, "ComputeCapExceeded", "compute cap violation", msg)
                to_stop += [(p.pid, start) for p, start in mine]
        self._sm = {k: v for k, v in self._sm.items() if k in live}
        self._sm_over = over_now
        return to_stop

    def _cut_grown(self, view: NodeView) -> None:
        """A claim's accounting file that its processes grew past its size (any process of the
        claim can write past its end) is cut back to its size with enforce=kill, so that a
        tenant cannot fill the node's disk through it; reported once per episode either way.
        The slice's processes map only the file's size: nothing they use is cut."""
        grown: set[str] = set()
        for u in view.unreadable:
            sl = u.slice
            if not sl.claim_uid:
                continue  # a `vgpu run --region` file is its user's
            try:
                fd = os.open(sl.region_path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC)  # fmt: skip
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size <= region.FILE_SIZE:
                    continue
                grown.add(sl.key)
                cut = self.enforce == "kill"
                if cut:
                    os.ftruncate(fd, region.FILE_SIZE)
                if sl.key not in self._grown:
                    what = "cut back to" if cut else "not cut (enforce none); it should be"
                    msg = (f"{_who(sl)}: its accounting file grew to {st.st_size} bytes (written "
                           f"from inside the claim); {what} {region.FILE_SIZE} bytes")  # fmt: skip
                    self._report(sl, "AccountingFileGrew", "accounting file grown", msg)
            except OSError as e:
                log.warning("watchdog: %s: %s", sl.region_path, e.strerror)
            finally:
                os.close(fd)
        self._grown = grown

    def without_shim(self) -> tuple[Unshimmed, ...]:
        """The slices' GPU processes that ran without the shim at the last pass."""
        with self._unshimmed_lock:
            return self._unshimmed

    def _slots(self, sl: Slice) -> dict[int, region.SlotLimits] | None:
        """What the claim's processes enforce, by their PID in their namespace (live slots);
        None for a --region slice or an unreadable file (nothing compared)."""
        if not sl.claim_uid:
            return None
        try:
            return {x.pid: x for x in region.read_slot_limits(sl.region_path)}
        except region.RegionError:
            return None

    def _not_enforcing(
        self,
        sl: Slice,
        pid: int,
        a: Attribution,
        slots: dict[int, region.SlotLimits] | None,
        genuine: set[tuple[int, int]] | None,
    ) -> str | None:
        """Why a claim's process with the plugin's shim does not enforce the claim's limits.
        First what the tenant cannot write: the file its shim reads, resolved in its own mount
        namespace, must be the claim's; then what the shim says in its slot."""
        if slots is None:
            return None
        want = self._claim_limits(sl)
        if want is None:
            return None
        if a.maps is not None and genuine:
            read = shim_limits_file(pid, self.proc_root, a.maps, genuine, CONTAINER_LIMITS_B)
            if read is not None and read[1] != want.ident[:2]:
                return (f"the limits file its shim reads ({printable(read[0])}) is not the "
                        "claim's: a mount of its own over the plugin's")  # fmt: skip
        got = slots.get(a.ns_pid)
        if got is None:
            return ("the shim never registered it in the slice's accounting file (it reached "
                    "the driver without going through the shim)")  # fmt: skip
        if got.source != region.LIMITS_FILE:
            return "its shim enforces limits from its environment, not the claim's limits file"
        if got.hash != want.hash:
            return (f"its shim enforces another limits file (device {got.dev}, inode {got.ino}) "
                    "than the claim's")  # fmt: skip
        return None

    def _without_shim(
        self,
        uuid: str,
        s: SliceDeviceView,
        procs: list[tuple[GpuProcess, Attribution]],
        found: list[Unshimmed],
        seen: set[tuple[int, int]],
        genuine: set[tuple[int, int]] | None,
        slots: dict[int, region.SlotLimits] | None,
    ) -> list[tuple[int, int]]:
        """Adds the slice's processes without the plugin's shim in force to found/seen; returns
        the new ones."""
        new = []
        claim = bool(s.slice.claim_uid)
        for p, a in procs:
            # a process nobody can inspect is a process nothing is known to limit
            missing = a.too_large or missing_shim(
                p.pid, self.proc_root, genuine if claim else None, a.maps
            )
            if missing is None and claim:
                missing = self._not_enforcing(s.slice, p.pid, a, slots, genuine)
            if missing is None:
                continue
            u = Unshimmed(s.slice, s.device, uuid, p.pid, p.used_bytes, missing)
            found.append(u)
            ident = (p.pid, a.start)
            seen.add(ident)
            if ident not in self._unshimmed_seen:
                self._report_unshimmed(u)
                new.append(ident)
        return new

    def _report(self, sl: Slice | None, reason: str, what: str, msg: str) -> None:
        """One log line and, in the plugin, one Event."""
        log.warning("watchdog: %s: %s", what, msg)
        if self.events is not None:
            self.events(sl, reason, msg)

    def _report_unshimmed(self, u: Unshimmed) -> None:
        msg = (
            f"{_who(u.slice)}: {_describe(u.pid)} uses GPU {u.gpu_uuid} ({u.used_bytes} bytes) "
            f"without the sharing shim, so no quota or compute cap applies to it: {u.why}"
        )
        self._report(u.slice, "ShimNotLoaded", "process without the shim", msg)

    def _blind(self, pid: int, why: str) -> None:
        """A GPU process we cannot inspect is never called a violation (a watchdog without
        hostPID or root would otherwise flag, and with --enforce kill stop, every process)."""
        if not self._warned_blind:
            self._warned_blind = True
            log.warning(
                "watchdog: cannot inspect GPU process pid %d: %s; processes it cannot see are "
                "not checked (run with the host's PID namespace, as root)",
                pid,
                why,
            )

    def _stray(self, uuid: str, p: GpuProcess, why: str) -> None:
        self.violations.add_unattributed(uuid)
        msg = (
            f"{_describe(p.pid)} holds {p.used_bytes} bytes on shared GPU {uuid} "
            f"but belongs to no slice: {why}"
        )
        self._report(None, "UnattributedGPUProcess", "quota violation", msg)

    def _over_quota(
        self,
        uuid: str,
        s: SliceDeviceView,
        procs: list[tuple[GpuProcess, Attribution]],
        total: int,
        view: NodeView,
        bound: int,
        what: str,
    ) -> list[tuple[int, int]]:
        sl = s.slice
        self.violations.add_slice(sl.key, s.device)
        c = view.counters[sl.key]
        charged = {
            pid: used[s.device] for pid, used in zip(c.live_pids, c.live_charged, strict=True)
        }
        # a process holds more than the shim charged it (nothing, if the shim never saw it)
        bypass = [(p, a) for p, a in procs
                  if p.used_bytes > charged.get(a.ns_pid, 0) + self.margin]  # fmt: skip
        msg = (
            f"{_who(sl)} holds {total} bytes on GPU {uuid} by NVML's count, over its "
            f"{what} {bound} + margin {self.margin}; holding more than the shim charged: "
            f"{', '.join(_describe(p.pid) for p, _ in bypass) or 'none'}"
        )
        self._report(sl, "QuotaExceeded", "quota violation", msg)
        if bypass:
            return [(p.pid, a.start) for p, a in bypass]
        out, rest = [], total
        for p, a in sorted(procs, key=lambda pa: -pa[0].used_bytes):
            if rest <= bound + self.margin:
                break
            out.append((p.pid, a.start))
            rest -= p.used_bytes
        return out

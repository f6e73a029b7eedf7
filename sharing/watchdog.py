"""The watchdog: NVML's per-process memory (the ground truth) against the slices' quotas.

The shim enforces quotas from inside the processes; a process that does not load it (a static
binary, a cleared LD_PRELOAD, a direct ioctl user) is invisible to it. The watchdog looks from
outside, after every NVML pass:

- Attribution: a GPU process belongs to the slice whose accounting file it names, as the
  process's own mount namespace sees it: CUDA_DEVICE_MEMORY_SHARED_CACHE from
  /proc/<pid>/environ, resolved under /proc/<pid>/root, compared by (st_dev, st_ino) with the
  claim's file. This needs no cooperation from the process and holds across containers (the
  exporter must see the host's PIDs: the plugin's DaemonSet runs with hostPID).
- A slice is in violation on a device when NVML's memory of its processes there exceeds its
  quota plus the margin (default 128 MiB: NVML counts per-process driver memory the shim does
  not charge). A GPU process of no slice on a device that has slices is a violation too.
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
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from sharing.nodeview import NodeView, SliceDeviceView, ViolationCounts
from sharing.nvml_reader import GpuProcess, NvmlReading
from sharing.slices import Slice

log = logging.getLogger(__name__)

DEFAULT_MARGIN = 128 << 20
ENFORCE_MODES = ("none", "kill")
REGION_ENV = b"CUDA_DEVICE_MEMORY_SHARED_CACHE="

# (the claim's slice, or None for a process of no slice; reason; message)
EventSink = Callable[[Slice | None, str, str], None]


@dataclass(frozen=True)
class Attribution:
    file_id: tuple[int, int] | None  # (st_dev, st_ino) of the accounting file it names
    ns_pid: int  # its PID in its own namespace (what the shim records in its slot)
    why: str  # when file_id is None: why it could not be attributed
    visible: bool = True  # False: we cannot look at the process (other PID namespace, no root)


def attribute(pid: int, proc_root: str = "/proc") -> Attribution:
    """Which accounting file the process names, as its own mount namespace sees it."""
    ns_pid = pid
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    ns_pid = int(line.split()[-1])
    except (OSError, ValueError):
        pass
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            env = f.read()
    except (FileNotFoundError, PermissionError) as e:
        # not a violation: the watchdog is blind here (no hostPID, or not root)
        return Attribution(None, ns_pid, f"cannot read its environment ({e.strerror})", False)
    except OSError as e:
        return Attribution(None, ns_pid, f"cannot read its environment ({e.strerror})")
    path = None
    for item in env.split(b"\0"):
        if item.startswith(REGION_ENV):
            path = item[len(REGION_ENV) :]
    if not path or not path.startswith(b"/"):
        return Attribution(None, ns_pid, "names no accounting file")
    try:
        st = os.lstat(f"{proc_root}/{pid}/root".encode() + path)
    except OSError as e:
        return Attribution(None, ns_pid, f"its accounting file is unreachable ({e.strerror})")
    return Attribution((st.st_dev, st.st_ino), ns_pid, "")


SHIM_NAME = b"/libvgpu"  # the shim's file name as mapped (CONTAINER_LIB, sharing/_lib)


# ELF header layout per class: (e_phoff format and offset, e_phentsize offset, word format,
# offsets of p_offset and p_filesz in a program header)
_ELF = {1: ("I", 28, 42, "I", 4, 16), 2: ("Q", 32, 54, "Q", 8, 32)}
PT_INTERP = 3


def interpreter(pid: int, proc_root: str = "/proc") -> bytes | None:
    """The program interpreter (PT_INTERP) of the process's executable; b"" for a static
    binary; None if unreadable. Read from the ELF headers, not guessed from the memory map (a
    musl loader is mapped under its libc's name)."""
    try:
        with open(f"{proc_root}/{pid}/exe", "rb") as f:
            head = f.read(64)
            if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in _ELF:
                return None
            end = "<" if head[5] == 1 else ">"  # EI_DATA: 1 little-endian, 2 big-endian
            off_fmt, phoff_at, ph_at, word, p_offset_at, p_filesz_at = _ELF[head[4]]
            (phoff,) = struct.unpack_from(end + off_fmt, head, phoff_at)
            phentsize, phnum = struct.unpack_from(end + "HH", head, ph_at)
            if phentsize == 0:
                return None
            f.seek(phoff)
            table = f.read(phentsize * min(phnum, 256))
            for at in range(0, len(table) - phentsize + 1, phentsize):
                if struct.unpack_from(end + "I", table, at)[0] != PT_INTERP:
                    continue
                (off,) = struct.unpack_from(end + word, table, at + p_offset_at)
                (size,) = struct.unpack_from(end + word, table, at + p_filesz_at)
                f.seek(off)
                return f.read(min(size, 4096)).rstrip(b"\0")
            return b""
    except (OSError, struct.error):
        return None


def missing_shim(pid: int, proc_root: str = "/proc") -> str | None:
    """None if the shim is mapped into the process (or we cannot tell); else why it is not."""
    try:
        with open(f"{proc_root}/{pid}/maps", "rb") as f:
            maps = f.read()
    except OSError:
        return None  # gone, or not ours to read: attribute() already said whether we are blind
    if any(SHIM_NAME in line for line in maps.splitlines() if b" /" in line):
        return None
    interp = interpreter(pid, proc_root)
    if interp is not None and b"musl" in interp:
        return "its C library is musl, whose loader never loads the shim (unsupported image)"
    if interp == b"":
        return "it is a static binary: no loader preloads the shim into it"
    return "the shim is not loaded into it (LD_PRELOAD cleared, or the loader refused it)"


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
        return f"pid {pid} ({p.name()}, user {p.username()})"
    except (psutil.Error, KeyError):
        return f"pid {pid}"


def _identity(pid: int) -> tuple[int, float]:
    try:
        return pid, psutil.Process(pid).create_time()
    except psutil.Error:
        return pid, 0.0


def _count_by_slice_device(found: list[Unshimmed]) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for u in found:
        out[(u.slice.key, u.device)] = out.get((u.slice.key, u.device), 0) + 1
    return out


def _stop(pids: list[int], grace: float) -> None:
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.terminate()
            procs.append(p)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            log.warning("watchdog: pid %d ignored SIGTERM for %gs; sending SIGKILL", p.pid, grace)
            p.kill()
        except psutil.Error:
            pass


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
    ) -> None:
        if enforce not in ENFORCE_MODES:
            raise ValueError(f"enforce {enforce!r} unknown; allowed: {', '.join(ENFORCE_MODES)}")
        self.violations = violations
        self.enforce = enforce
        self.margin = margin
        self.kill_grace = kill_grace
        self.events = events
        self.proc_root = proc_root
        self._over: set[tuple[str, int]] = set()  # (slice key, device): episodes in progress
        self._strays: set[tuple[int, float]] = set()  # unattributed processes already counted
        self._unshimmed_seen: set[tuple[int, float]] = set()  # reported processes without shim
        self._unshimmed: tuple[Unshimmed, ...] = ()
        self._unshimmed_lock = threading.Lock()
        self._self = os.getpid()
        self._warned_blind = False

    def check(self, view: NodeView, reading: NvmlReading) -> None:
        files = {(c.st_dev, c.st_ino): key for key, c in view.counters.items()}
        devices = {d.gpu.uuid: d for d in view.devices}
        over_now: set[tuple[str, int]] = set()
        strays_now: set[tuple[int, float]] = set()
        unshimmed: list[Unshimmed] = []
        unshimmed_seen: set[tuple[int, float]] = set()
        to_stop: list[int] = []
        for gpu in reading.gpus:
            dv = devices.get(gpu.uuid)
            if dv is None or not gpu.processes:
                continue
            on_dev = {s.slice.key: s for s in dv.slices}
            mine: dict[str, list[tuple[GpuProcess, Attribution]]] = {}
            for p in gpu.processes:
                if p.pid == self._self:
                    continue
                a = attribute(p.pid, self.proc_root)
                if not a.visible:
                    self._blind(p.pid, a.why)
                    continue
                key = files.get(a.file_id) if a.file_id else None
                if key is not None and key in on_dev:
                    mine.setdefault(key, []).append((p, a))
                elif dv.slices:
                    ident = _identity(p.pid)
                    strays_now.add(ident)
                    if ident not in self._strays:
                        why = a.why or "its slice has no share of this GPU"
                        self._stray(gpu.uuid, p, why)
                        to_stop.append(p.pid)
            for key, procs in mine.items():
                s = on_dev[key]
                to_stop += self._without_shim(gpu.uuid, s, procs, unshimmed, unshimmed_seen)
                total = sum(p.used_bytes for p, _ in procs)
                if s.memory_limit <= 0 or total <= s.memory_limit + self.margin:
                    continue
                over_now.add((key, s.device))
                if (key, s.device) not in self._over:
                    to_stop += self._over_quota(gpu.uuid, s, procs, total, view)
        self._over = over_now
        self._strays = strays_now
        self._unshimmed_seen = unshimmed_seen
        with self._unshimmed_lock:
            self._unshimmed = tuple(unshimmed)
        self.violations.set_without_shim(_count_by_slice_device(unshimmed))
        to_stop = list(dict.fromkeys(to_stop))  # a process can be an offender twice over
        if to_stop and self.enforce == "kill":
            log.warning("watchdog: stopping pids %s (SIGTERM, SIGKILL after %gs)",
                        to_stop, self.kill_grace)  # fmt: skip
            threading.Thread(
                target=_stop, args=(to_stop, self.kill_grace), name="watchdog-kill", daemon=True
            ).start()

    def without_shim(self) -> tuple[Unshimmed, ...]:
        """The slices' GPU processes that ran without the shim at the last pass."""
        with self._unshimmed_lock:
            return self._unshimmed

    def _without_shim(
        self,
        uuid: str,
        s: SliceDeviceView,
        procs: list[tuple[GpuProcess, Attribution]],
        found: list[Unshimmed],
        seen: set[tuple[int, float]],
    ) -> list[int]:
        """Adds the slice's processes without the shim to found/seen; returns the new ones."""
        new = []
        for p, _ in procs:
            missing = missing_shim(p.pid, self.proc_root)
            if missing is None:
                continue
            u = Unshimmed(s.slice, s.device, uuid, p.pid, p.used_bytes, missing)
            found.append(u)
            ident = _identity(p.pid)
            seen.add(ident)
            if ident not in self._unshimmed_seen:
                self._report_unshimmed(u)
                new.append(p.pid)
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
    ) -> list[int]:
        sl = s.slice
        self.violations.add_slice(sl.key, s.device)
        c = view.counters[sl.key]
        charged = {
            pid: used[s.device] for pid, used in zip(c.live_pids, c.live_charged, strict=True)
        }
        # a process holds more than the shim charged it (nothing, if the shim never saw it)
        bypass = [p for p, a in procs if p.used_bytes > charged.get(a.ns_pid, 0) + self.margin]
        msg = (
            f"{_who(sl)} holds {total} bytes on GPU {uuid} by NVML's count, over its quota "
            f"{s.memory_limit} + margin {self.margin}; holding more than the shim charged: "
            f"{', '.join(_describe(p.pid) for p in bypass) or 'none'}"
        )
        self._report(sl, "QuotaExceeded", "quota violation", msg)
        if bypass:
            return [p.pid for p in bypass]
        out, rest = [], total
        for p, _ in sorted(procs, key=lambda pa: -pa[0].used_bytes):
            if rest <= s.memory_limit + self.margin:
                break
            out.append(p.pid)
            rest -= p.used_bytes
        return out

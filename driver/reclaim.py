"""Taking borrowed memory back (docs/policy.md, "Taking it back"): what a bursting slice borrows,
its processes, and the two policies, `wait` and `evict`.

A slice's borrowed bytes on a device are the larger of two measures above its request:

- its live processes' charges there (its accounting file, read as an observer reads it: pread,
  never mapped), which the tenant can write;
- the host NVML's per-process memory of its processes on that GPU, which it cannot, less the
  watchdog's margin (NVML counts per-process driver memory the shim does not charge). NVML's
  processes are attributed to the slice exactly as the watchdog attributes them
  (sharing/observe/procinfo.attribute: the accounting file a process has mapped or open, else the
  one it names inside its own root). No NVML reading (none given, NVML down, the GPU not listed):
  the accounting file's measure alone.

Its processes are the host processes that have its accounting file mapped (its device and inode
in /proc/<pid>/maps: a tenant cannot map another claim's file) and those NVML lists on the GPU
that are attributed to it. Stopping goes newest process first (start time in /proc/<pid>/stat)
among those that hold device memory there (by NVML, or by their slot in the accounting file),
each checked to be the process that was seen (a pidfd opened before the check), one at a time
until the slice fits its grant.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sharing import region
from sharing.observe.nvml_reader import NvmlReading
from sharing.observe.procinfo import attribute, ns_pid, scan_maps, start_time
from sharing.observe.watchdog import DEFAULT_MARGIN

NvmlRead = Callable[[], NvmlReading]  # one fresh NVML pass (sharing/observe/nvml_reader.read_nvml)

log = logging.getLogger(__name__)

POLL = 0.02  # seconds between looks at a slice's usage
EXIT_WAIT = 5.0  # seconds a stopped process has to vanish before the next one is stopped


@dataclass(frozen=True)
class Borrower:
    """A bursting (claim, device) whose grant fell below what it borrows."""

    uid: str
    namespace: str
    name: str
    gpu: int  # host GPU index
    container_index: int  # the device's index in the slice (its limits file, accounting file)
    request: int
    grant: int
    accounting: Path
    uuid: str = ""  # the GPU's UUID, as NVML names it
    nvml: NvmlRead | None = field(default=None, compare=False, repr=False)
    margin: int = DEFAULT_MARGIN  # what NVML may count above the shim's charges

    def nvml_held(self, reading: NvmlReading | None = None) -> dict[int, tuple[int, int]]:
        """pid -> (start time, bytes) of the slice's processes NVML lists on the GPU, in
        `reading` (None: a fresh pass)."""
        if self.nvml is None or not self.uuid:
            return {}
        return nvml_held(self.accounting, self.uuid, reading or self.nvml())

    def borrowed(self, reading: NvmlReading | None = None) -> int:
        """The larger of the accounting file's and NVML's measure (module docstring)."""
        own = borrowed(self.accounting, self.container_index, self.request)
        held = sum(b for _, b in self.nvml_held(reading).values())
        return max(own, held - self.margin - self.request, 0)

    def fits(self, reading: NvmlReading | None = None) -> bool:
        return self.borrowed(reading) <= self.grant

    @property
    def claim(self) -> str:
        return f"{self.namespace}/{self.name}"


def borrowed(accounting: Path, index: int, request: int) -> int:
    """Bytes the slice's live processes hold on its device `index` above `request` (0 when the
    file cannot be read: a slice that never ran)."""
    try:
        snap = region.read(accounting)
    except (OSError, region.RegionError):
        return 0
    if not 0 <= index < len(snap.devices):
        return 0
    return max(0, snap.used_by_live(index) - request)


def nvml_held(
    accounting: Path, uuid: str, reading: NvmlReading, proc_root: str = "/proc"
) -> dict[int, tuple[int, int]]:
    """pid -> (start time, bytes NVML says it holds) of the processes NVML lists on GPU `uuid`
    that belong to the slice of `accounting`, attributed as the watchdog attributes them."""
    gpu = next((g for g in reading.gpus if g.uuid == uuid), None)
    if gpu is None or not gpu.processes:
        return {}
    try:
        st = os.stat(accounting)
    except OSError:
        return {}
    ident = (st.st_dev, st.st_ino)
    out = {}
    for p in gpu.processes:
        a = attribute(p.pid, proc_root, {ident: accounting})
        if a.file_id == ident:
            out[p.pid] = (a.start, p.used_bytes)
    return out


def slice_pids(accounting: Path, proc_root: str = "/proc") -> list[tuple[int, int]]:
    """(pid, start time) of the host processes that have the accounting file mapped, newest
    first."""
    try:
        st = os.stat(accounting)
    except OSError:
        return []
    want = frozenset({(st.st_dev, st.st_ino)})
    out = []
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            if scan_maps(pid, proc_root, want).found:
                out.append((pid, start_time(pid, proc_root)))
        except Exception:  # gone, or too large to read: not a process we can attribute
            continue
    return sorted(out, key=lambda p: (p[1], p[0]), reverse=True)


def notify(b: Borrower) -> list[int]:
    """SIGWINCH to every process of the slice; returns their pids."""
    pids = [p for p, _ in slice_pids(b.accounting)]
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGWINCH)
    return pids


def one_reading(borrowers: Sequence[Borrower]) -> NvmlReading | None:
    """One NVML pass for a round of looks at several borrowers (a pass reads every GPU: one per
    borrower per poll would cost a node of many GPUs that many passes)."""
    read = next((b.nvml for b in borrowers if b.nvml is not None and b.uuid), None)
    return read() if read is not None else None


def wait_until(done: Callable[[], bool], deadline: float) -> bool:
    """Poll done() until it is true or time.monotonic() passes deadline."""
    while True:
        if done():
            return True
        if time.monotonic() >= deadline:
            return done()
        time.sleep(POLL)


def holders(b: Borrower) -> list[tuple[int, int]]:
    """(pid, start time) of the slice's processes that hold device memory on the borrower's
    device, by NVML or by their slot in the accounting file, newest first."""
    nvml = b.nvml_held()
    try:
        snap = region.read(b.accounting)
        charged = {p.pid for p in snap.processes if p.alive and p.used[b.container_index] > 0}
    except (OSError, region.RegionError, IndexError):
        charged = set()
    procs = dict(slice_pids(b.accounting))
    procs.update({pid: start for pid, (start, _) in nvml.items()})
    out = [(pid, start) for pid, start in procs.items()
           if nvml.get(pid, (0, 0))[1] > 0 or ns_pid(pid) in charged]  # fmt: skip
    return sorted(out, key=lambda p: (p[1], p[0]), reverse=True)


def stop_until_fits(b: Borrower) -> list[int]:
    """SIGKILL the slice's processes that hold device memory, newest first, one at a time, until
    it fits its grant. Returns the pids stopped."""
    stopped: list[int] = []
    while not b.fits():
        procs = [p for p in holders(b) if p[0] not in stopped]
        if not procs:
            break
        pid, start = procs[0]
        if _kill(pid, start):
            stopped.append(pid)
            wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists() or _zombie(pid),  # type: ignore[misc]
                       time.monotonic() + EXIT_WAIT)  # fmt: skip
            # the driver frees a dead process's memory; its slot stops counting as live
            wait_until(b.fits, time.monotonic() + 0.5)
        else:
            stopped.append(pid)  # gone or reused meanwhile: not ours to stop
    return stopped


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def _kill(pid: int, start: int) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if start_time(pid) != start:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        log.warning("burst reclaim: stopped process %d (SIGKILL)", pid)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def describe(borrowers: Sequence[Borrower]) -> str:
    return ", ".join(f"claim {b.claim}" for b in borrowers)

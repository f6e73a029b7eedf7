"""A slice's counters, read for observers (exporter, `vgpu top`, watchdog): fast and lock-free.

Unlike region.read() (a full snapshot of all 16 devices and 1024 process slots), this reads only
the devices asked for and the process slots below slots_hwm, and opens the file the way a
reader of a shared directory must: without following a link (a tenant can write in its claim
directory), non-blocking (a FIFO put there must not hang a scrape), and only if it is a regular
file. Every word is read once through cffi from the shared mapping: an aligned 64-bit load the
shim stores atomically (region.h), so a value is never torn and the shim is never blocked.
"""

from __future__ import annotations

import mmap
import os
import stat
from dataclasses import dataclass

from sharing import region
from sharing._region_cffi import lib


@dataclass(frozen=True)
class DeviceCounters:
    index: int  # device index inside the slice (position in its CUDA_VISIBLE_DEVICES)
    limit: int  # bytes the region's creator recorded (0 = none)
    used: int  # bytes held by live processes
    peak: int  # highest `used` seen
    denials: int  # allocations refused over quota
    denied_bytes: int  # bytes those refused allocations asked for
    cap_permille: int  # SM cap as the compute gate recorded it (0 = none recorded yet)
    launches: int  # launches admitted (charged) by the compute gate
    charged_ns: int  # device time charged by the compute gate
    wait_ns: int  # time launches were held back by the gate


@dataclass(frozen=True)
class SliceCounters:
    path: str
    st_dev: int  # identity of the file (the watchdog matches processes' files against it)
    st_ino: int
    devices: tuple[DeviceCounters, ...]
    live_pids: tuple[int, ...]  # pids (in their own PID namespace) of live slot holders
    live_charged: tuple[tuple[int, ...], ...] = ()  # bytes each of them charged, per device


def open_nofollow(path: str) -> int:
    """Open a file of a shared directory read-only: no link, no FIFO wait, regular files only."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise region.RegionError(f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Mapped:
    """One accounting file kept open and mapped between reads (identity checked at each read)."""

    def __init__(self, path: str) -> None:
        try:
            fd = open_nofollow(path)
        except OSError as e:
            raise region.RegionError(f"{path}: cannot open: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if st.st_size != region.FILE_SIZE:
                region._check_header_version(path, fd, st.st_size)
                region._validate(path, b"", st.st_size)
            self.map = mmap.mmap(fd, region.FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.ident = (st.st_dev, st.st_ino)
        try:
            self.r = region._validate(path, self.map, st.st_size)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.r = None  # the cffi view holds the mapping's buffer: drop it first
        self.map.close()
        os.close(self.fd)

    def read(self, path: str, n: int) -> SliceCounters:
        r = self.r
        hwm = min(int(r.slots_hwm), region.MAX_PROCS)
        live_used = [0] * n
        pids = []
        charged = []
        procs = r.procs
        for i in range(hwm):
            s = procs[i]
            if s.state != lib.VGPU_SLOT_LIVE or not region._slot_alive(self.fd, i):
                continue
            pids.append(int(s.pid))
            used = tuple(int(u) for u in s.used[0:n])
            charged.append(used)
            for d in range(n):
                live_used[d] += used[d]
        devices = []
        accounts, compute = r.devices, r.compute
        for d in range(n):
            a, c = accounts[d], compute[d]
            devices.append(
                DeviceCounters(
                    index=d,
                    limit=int(a.limit),
                    # `used` includes slots of dead processes not yet reclaimed: what live hold
                    used=min(int(a.used), live_used[d]),
                    peak=int(a.peak),
                    denials=int(a.denials),
                    denied_bytes=int(a.denied_bytes),
                    cap_permille=int(c.cap_permille),
                    launches=int(c.launches),
                    charged_ns=max(0, int(c.charged_ns)),
                    wait_ns=int(c.wait_ns),
                )
            )
        return SliceCounters(
            path, self.ident[0], self.ident[1], tuple(devices), tuple(pids), tuple(charged)
        )


class CounterReader:
    """Reads slices' counters, keeping each file mapped between reads (a scrape of hundreds of
    slices then costs no open/mmap per slice). Before every read the path is checked with lstat:
    a file replaced, removed or turned into a link is dropped and opened again (or refused).
    Not thread-safe: one per caller."""

    def __init__(self) -> None:
        self._open: dict[str, _Mapped] = {}

    def read(self, path: str, ndevices: int, ident: tuple[int, int] | None = None) -> SliceCounters:
        """Counters of devices [0, ndevices) of the slice whose accounting file is `path`.

        `ident`: (st_dev, st_ino) the caller just saw at `path` (saves an lstat).

        Raises region.RegionError (one line) when the file is missing, a link, not a regular
        file, or not a valid region of this layout (an old layout is named by its version).
        """
        n = max(0, min(ndevices, region.MAX_DEVICES))
        m = self._open.get(path)
        if m is not None:
            if ident is not None:
                same = ident == m.ident
            else:
                try:
                    st = os.stat(path, follow_symlinks=False)
                    same = (st.st_dev, st.st_ino) == m.ident and stat.S_ISREG(st.st_mode)
                except OSError:
                    same = False
            if not same:
                m.close()
                del self._open[path]
                m = None
        if m is None:
            m = _Mapped(path)
            self._open[path] = m
        return m.read(path, n)

    def forget_except(self, keep: set[str]) -> None:
        """Unmap the files of slices that are gone."""
        for p in [p for p in self._open if p not in keep]:
            self._open.pop(p).close()

    def close(self) -> None:
        self.forget_except(set())


def read_counters(path: str, ndevices: int) -> SliceCounters:
    """One read, nothing kept open (CounterReader for repeated reads)."""
    m = _Mapped(path)
    try:
        return m.read(path, max(0, min(ndevices, region.MAX_DEVICES)))
    finally:
        m.close()

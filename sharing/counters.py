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


def read_counters(path: str, ndevices: int) -> SliceCounters:
    """Counters of devices [0, ndevices) of the slice whose accounting file is `path`.

    Raises region.RegionError (one line) when the file is missing, a link, or not a valid region
    of this layout (an old layout is named by its version).
    """
    n = max(0, min(ndevices, region.MAX_DEVICES))
    try:
        fd = open_nofollow(path)
    except OSError as e:
        raise region.RegionError(f"{path}: cannot open: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if st.st_size != region.FILE_SIZE:
            region._check_header_version(path, fd, st.st_size)
            region._validate(path, b"", st.st_size)
        with mmap.mmap(fd, region.FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            r = region._validate(path, m, st.st_size)
            a = c = s = None  # cffi views into the mapping: all dropped before it closes
            devices = []
            for d in range(n):
                a, c = r.devices[d], r.compute[d]
                devices.append(
                    DeviceCounters(
                        index=d,
                        limit=int(a.limit),
                        used=int(a.used),
                        peak=int(a.peak),
                        denials=int(a.denials),
                        denied_bytes=int(a.denied_bytes),
                        cap_permille=int(c.cap_permille),
                        launches=int(c.launches),
                        charged_ns=max(0, int(c.charged_ns)),
                        wait_ns=int(c.wait_ns),
                    )
                )
            hwm = min(int(r.slots_hwm), region.MAX_PROCS)
            live_used = [0] * n
            pids = []
            for i in range(hwm):
                s = r.procs[i]
                if s.state != lib.VGPU_SLOT_LIVE or not region._slot_alive(fd, i):
                    continue
                pids.append(int(s.pid))
                for d in range(n):
                    live_used[d] += int(s.used[d])
            del r, a, c, s  # release the buffer export before the mmap closes
        # `used` includes slots of dead processes not yet reclaimed: report what live ones hold
        out = tuple(
            DeviceCounters(**{**dc.__dict__, "used": min(dc.used, live_used[dc.index])})
            for dc in devices
        )
        return SliceCounters(path, st.st_dev, st.st_ino, out, tuple(pids))
    finally:
        os.close(fd)

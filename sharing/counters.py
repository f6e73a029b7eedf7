"""A slice's counters, read for observers (exporter, `vgpu top`, watchdog): fast and lock-free.

Unlike region.read() (a full snapshot of all 64 devices and 1024 process slots), this reads only
the devices asked for and the process slots below slots_hwm, and opens the file the way a
reader of a shared directory must: without following a link (a tenant can write in its claim
directory), non-blocking (a FIFO put there must not hang a scrape), and only if it is a regular
file.

The file is the tenant's: any process of the slice can write, truncate or grow it. So it is never
mapped here (a mapping of a file truncated under it faults with SIGBUS, which would kill the
plugin or the exporter): every read is an fstat (the size must be the layout's) and up to two
preads (the header up to the compute state of the devices asked for; the slots below
slots_hwm), and the header is checked at every read. A file of the wrong size or layout, or one cut short between the fstat and the
pread, raises RegionError for that slice alone. The shim is never blocked. The kernel's copy
does not promise to copy a word the shim is storing at that instant in one piece (an aligned load from
a mapping would):
such a word may read torn once, and the next read is right again. The figures are the tenant's
in any case: the observers bound them (sharing/observe/nodeview.py).
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass

from sharing import region
from sharing._region_cffi import ffi, lib

# Offsets from the cffi binding of region.h (never hard-coded). Words are read with native-order
# struct formats at their natural alignment: each is one aligned load (CPython copies a native
# field with a memcpy of its size), the same access as a cffi field read, at a fraction of the
# cost for hundreds of slices.
_OFF_HWM = ffi.offsetof("struct vgpu_region", "slots_hwm")
_OFF_DEVICES = ffi.offsetof("struct vgpu_region", "devices")
_OFF_COMPUTE = ffi.offsetof("struct vgpu_region", "compute")
_OFF_PROCS = ffi.offsetof("struct vgpu_region", "procs")
_ACCOUNT_SIZE = ffi.sizeof("struct vgpu_device_account")
_COMPUTE_SIZE = ffi.sizeof("struct vgpu_compute_state")
_SLOT_SIZE = ffi.sizeof("struct vgpu_proc_slot")
_OFF_LAUNCHES = ffi.offsetof("struct vgpu_compute_state", "launches")
_OFF_CHARGED = ffi.offsetof("struct vgpu_compute_state", "charged_ns")
_OFF_WAIT = ffi.offsetof("struct vgpu_compute_state", "wait_ns")
_OFF_SLOT_USED = ffi.offsetof("struct vgpu_proc_slot", "used")
_U32, _U64, _I64 = struct.Struct("@I"), struct.Struct("@Q"), struct.Struct("@q")
# used, peak, denials, denied_bytes (no limit: region.h), then the learned context size (not read)
_ACCOUNT = struct.Struct("@4Q")
_ACCOUNT_LEARNED = ffi.offsetof("struct vgpu_device_account", "context_bytes")
_SLOT_HEAD = struct.Struct("@iI")  # pid, state
assert _ACCOUNT.size == _ACCOUNT_LEARNED and ffi.offsetof("struct vgpu_proc_slot", "state") == 4
_USED = [struct.Struct(f"@{n}Q") for n in range(region.MAX_DEVICES + 1)]


def _used(n: int) -> struct.Struct:
    return _USED[n]


@dataclass(frozen=True)
class DeviceCounters:
    index: int  # device index inside the slice (position in its CUDA_VISIBLE_DEVICES)
    used: int  # bytes held by live processes
    peak: int  # highest `used` seen
    denials: int  # allocations refused over quota
    denied_bytes: int  # bytes those refused allocations asked for
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


class _Open:
    """One accounting file kept open between reads (identity checked before each read)."""

    def __init__(self, path: str) -> None:
        try:
            fd = open_nofollow(path)
        except OSError as e:
            raise region.RegionError(f"{path}: cannot open: {e.strerror}") from e
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.ident = (st.st_dev, st.st_ino)

    def close(self) -> None:
        os.close(self.fd)

    def _pread(self, path: str, size: int, offset: int) -> bytes:
        buf = os.pread(self.fd, size, offset)
        if len(buf) != size:
            raise region.RegionError(
                f"{path}: cut short while read (size now below {region.FILE_SIZE} bytes; "
                f"not a vgpu accounting file of layout {region.LAYOUT_VERSION})"
            )
        return buf

    def read(self, path: str, n: int) -> SliceCounters:
        fd = self.fd
        try:
            size = os.fstat(fd).st_size
            if size != region.FILE_SIZE:
                region._check_header_version(path, fd, size)
                region.check_size(path, size)
            # what is asked, in one copy: the header, the device accounts up to the compute
            # states of the first n devices (the whole fixed part would be 35 KiB per slice)
            head = self._pread(path, _OFF_COMPUTE + n * _COMPUTE_SIZE, 0)
            region.check_header(path, head)
            hwm = min(_U32.unpack_from(head, _OFF_HWM)[0], region.MAX_PROCS)
            slots = self._pread(path, hwm * _SLOT_SIZE, _OFF_PROCS) if hwm else b""
        except OSError as e:
            raise region.RegionError(f"{path}: cannot read: {e.strerror or e}") from e
        live_used = [0] * n
        pids = []
        charged = []
        for i in range(hwm):
            base = i * _SLOT_SIZE
            pid, state = _SLOT_HEAD.unpack_from(slots, base)
            if state != lib.VGPU_SLOT_LIVE or not region._slot_alive(fd, i):
                continue
            pids.append(pid)
            used = _used(n).unpack_from(slots, base + _OFF_SLOT_USED)
            charged.append(used)
            for d in range(n):
                live_used[d] += used[d]
        devices = []
        for d in range(n):
            used_now, peak, denials, denied_bytes = _ACCOUNT.unpack_from(
                head, _OFF_DEVICES + d * _ACCOUNT_SIZE
            )
            c = _OFF_COMPUTE + d * _COMPUTE_SIZE
            devices.append(
                DeviceCounters(
                    index=d,
                    # `used` includes slots of dead processes not yet reclaimed: what live hold
                    used=min(used_now, live_used[d]),
                    peak=peak,
                    denials=denials,
                    denied_bytes=denied_bytes,
                    launches=_U64.unpack_from(head, c + _OFF_LAUNCHES)[0],
                    charged_ns=max(0, _I64.unpack_from(head, c + _OFF_CHARGED)[0]),
                    wait_ns=_U64.unpack_from(head, c + _OFF_WAIT)[0],
                )
            )
        return SliceCounters(
            path, self.ident[0], self.ident[1], tuple(devices), tuple(pids), tuple(charged)
        )


class CounterReader:
    """Reads slices' counters, keeping each file open between reads (a scrape of hundreds of
    slices then costs no open per slice). Before every read the path is checked with lstat:
    a file replaced, removed or turned into a link is dropped and opened again (or refused).
    Not thread-safe: one per caller."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}

    def read(self, path: str, ndevices: int, ident: tuple[int, int] | None = None) -> SliceCounters:
        """Counters of devices [0, ndevices) of the slice whose accounting file is `path`.

        `ident`: (st_dev, st_ino) the caller just saw at `path` (saves an lstat).

        Raises region.RegionError (one line) when the file is missing, a link, not a regular
        file, or not a valid region of this layout at this read (wrong size, header or version:
        an old layout is named by its version).
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
            m = _Open(path)
            self._open[path] = m
        return m.read(path, n)

    def forget_except(self, keep: set[str]) -> None:
        """Close the files of slices that are gone."""
        for p in [p for p in self._open if p not in keep]:
            self._open.pop(p).close()

    def close(self) -> None:
        self.forget_except(set())


def read_counters(path: str, ndevices: int) -> SliceCounters:
    """One read, nothing kept open (CounterReader for repeated reads)."""
    m = _Open(path)
    try:
        return m.read(path, max(0, min(ndevices, region.MAX_DEVICES)))
    finally:
        m.close()

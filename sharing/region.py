"""The slice accounting file (CUDA_DEVICE_MEMORY_SHARED_CACHE), read from Python.

The layout is shim/include/vgpu/region.h, seen through cffi (sharing._region_cffi); the protocol
is described there. This module opens a region read-only and takes consistent-enough snapshots
(the counters are aligned 64-bit words the shim stores atomically; a snapshot reads them without
the lock, so it never blocks the shim and never sees a torn word),
tells live processes from dead ones the way the shim does (the slot's byte lock), and can
create a region atomically (for the DRA driver, or `vgpu run`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sharing._region_cffi import ffi, lib

MAGIC: int = lib.VGPU_REGION_MAGIC
LAYOUT_VERSION: int = lib.VGPU_REGION_LAYOUT_VERSION
MAX_DEVICES: int = lib.VGPU_MAX_DEVICES
MAX_PROCS: int = lib.VGPU_MAX_PROCS
FILE_SIZE: int = ffi.sizeof("struct vgpu_region")

# struct flock on Linux x86-64/aarch64: short l_type, short l_whence, off_t l_start, off_t l_len,
# pid_t l_pid (+ padding)
_FLOCK = "hhxxxxqqixxxx"


class RegionError(Exception):
    """The file is not a usable accounting region. str() is one line naming the file and why."""


@dataclass(frozen=True)
class DeviceUsage:
    index: int  # device index as the application sees it
    limit: int  # bytes written by the region's creator (0 = none)
    used: int  # bytes charged by live and not-yet-reclaimed processes
    peak: int
    denials: int
    denied_bytes: int = 0  # bytes asked for by the refused allocations (layout 4)


@dataclass(frozen=True)
class ComputeUsage:
    """One device's compute-gate counters (struct vgpu_compute_state), all cumulative."""

    index: int
    cap_permille: int  # the slice's SM cap on this device (0 = no cap written yet)
    launches: int  # launches admitted through the gate (charged)
    charged_ns: int  # device time charged (estimates at admission + measured corrections)
    throttled: int  # launches that had to wait for budget
    wait_ns: int  # total time launches were held back by the gate


@dataclass(frozen=True)
class ProcessUsage:
    slot: int
    pid: int  # in the process's own PID namespace
    alive: bool  # holds its slot lock; a dead one is reclaimed at the next allocation
    used: tuple[int, ...]  # bytes per device index


@dataclass(frozen=True)
class RegionSnapshot:
    path: str
    layout_version: int
    devices: tuple[DeviceUsage, ...]
    processes: tuple[ProcessUsage, ...]  # slots in use (live or dead-unreclaimed)
    lock_recoveries: int
    reclaimed_slots: int
    compute: tuple[ComputeUsage, ...] = ()

    def used_by_live(self, device: int) -> int:
        """Bytes on `device` held by live processes (what `used` becomes once dead slots are reclaimed)."""
        return sum(p.used[device] for p in self.processes if p.alive)


def _slot_alive(fd: int, slot: int) -> bool:
    """True if some open file description holds slot's byte lock (its owner is alive)."""
    req = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, lib.VGPU_SLOT_LOCK_BASE + slot, 1, 0)
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, req)
    l_type = struct.unpack(_FLOCK, res)[0]
    return bool(l_type != fcntl.F_UNLCK)


_HEADER = struct.Struct("<II")  # magic, layout_version: the start of every layout


def _check_header_version(path: str, fd: int, size: int) -> None:
    """A file of another layout has another size: name its version rather than its size."""
    head = os.pread(fd, _HEADER.size, 0)
    if len(head) < _HEADER.size:
        return
    magic, version = _HEADER.unpack(head)
    if magic == MAGIC and version != LAYOUT_VERSION:
        raise RegionError(
            f"{path}: layout version {version}, this reader knows {LAYOUT_VERSION} "
            "(written by another vgpu-sharing version; recreate the slice)"
        )


def _validate(path: str, buf: Any, size: int) -> Any:
    if size != FILE_SIZE:
        raise RegionError(
            f"{path}: size {size} bytes, expected {FILE_SIZE} "
            f"(not a vgpu accounting file of layout {LAYOUT_VERSION})"
        )
    r = ffi.cast("struct vgpu_region *", ffi.from_buffer(buf))
    h = r.header
    if h.magic != MAGIC:
        raise RegionError(f"{path}: wrong magic {h.magic:#x} (not a vgpu accounting file)")
    if h.layout_version != LAYOUT_VERSION:
        raise RegionError(
            f"{path}: layout version {h.layout_version}, this reader knows {LAYOUT_VERSION}"
        )
    if h.file_size != FILE_SIZE or h.max_devices != MAX_DEVICES or h.max_procs != MAX_PROCS:
        raise RegionError(f"{path}: header sizes disagree with layout {LAYOUT_VERSION}")
    return r


def read(path: str | os.PathLike[str]) -> RegionSnapshot:
    """Snapshot the region at path. Raises RegionError (one line) if it is missing or not valid."""
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise RegionError(f"{p}: cannot open: {e.strerror}") from e
    try:
        size = os.fstat(fd).st_size
        if size != FILE_SIZE:
            _check_header_version(p, fd, size)
            _validate(p, b"", size)
        with mmap.mmap(fd, FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            r = _validate(p, m, size)
            devices = tuple(
                DeviceUsage(
                    index=d,
                    limit=int(r.devices[d].limit),
                    used=int(r.devices[d].used),
                    peak=int(r.devices[d].peak),
                    denials=int(r.devices[d].denials),
                    denied_bytes=int(r.devices[d].denied_bytes),
                )
                for d in range(MAX_DEVICES)
            )
            compute = tuple(_compute_usage(d, r.compute[d]) for d in range(MAX_DEVICES))
            procs = tuple(
                ProcessUsage(
                    slot=i,
                    pid=int(r.procs[i].pid),
                    alive=_slot_alive(fd, i),
                    used=tuple(int(u) for u in r.procs[i].used),
                )
                for i in range(MAX_PROCS)
                if r.procs[i].state == lib.VGPU_SLOT_LIVE
            )
            snap = RegionSnapshot(
                path=p,
                layout_version=int(r.header.layout_version),
                devices=devices,
                processes=procs,
                lock_recoveries=int(r.lock_recoveries),
                reclaimed_slots=int(r.reclaimed_slots),
                compute=compute,
            )
            del r  # release the buffer export before the mmap closes
            return snap
    finally:
        os.close(fd)


def _compute_usage(index: int, st: Any) -> ComputeUsage:
    return ComputeUsage(
        index=index,
        cap_permille=int(st.cap_permille),
        launches=int(st.launches),
        charged_ns=max(0, int(st.charged_ns)),  # corrections may briefly undershoot
        throttled=int(st.throttled),
        wait_ns=int(st.wait_ns),
    )


def _fill(fd: int, limits: Mapping[int, int]) -> None:
    os.ftruncate(fd, FILE_SIZE)
    with mmap.mmap(fd, FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        r = ffi.cast("struct vgpu_region *", ffi.from_buffer(m))
        if lib.vgpu_region_init_lock(r) != 0:
            raise RegionError("cannot initialise the region's lock")
        for d, v in limits.items():
            r.devices[d].limit = v
        r.header.created_unix_ns = time.time_ns()
        r.header.max_devices = MAX_DEVICES
        r.header.max_procs = MAX_PROCS
        r.header.file_size = FILE_SIZE
        r.header.layout_version = LAYOUT_VERSION
        r.header.magic = MAGIC  # last: a file with the magic is complete
        del r


def _check_limits(limits: Mapping[int, int] | None) -> dict[int, int]:
    out = dict(limits or {})
    for d, v in out.items():
        if not 0 <= d < MAX_DEVICES:
            raise RegionError(f"device index {d} out of range 0..{MAX_DEVICES - 1}")
        if not 0 <= v < 2**64:
            raise RegionError(f"limit {v} for device {d} out of range")
    return out


def create(
    path: str | os.PathLike[str], limits: Mapping[int, int] | None = None, mode: int | None = None
) -> bool:
    """Create the region at path atomically (built in a temp file, then link()ed into place).

    Returns True if this call created it, False if it already existed (it is then left as is;
    validate it with read()). `limits` maps device index -> bytes, recorded as the slice's quota.
    `mode`: the file's permissions exactly (e.g. 0o666 for processes of several users, as the
    DRA driver may need); None: 0o666 narrowed by the umask, as the shim creates it.
    """
    p = Path(path)
    lim = _check_limits(limits)
    tmp = p.with_name(f"{p.name}.tmp.{os.getpid()}.{time.monotonic_ns()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # exactly as asked, not narrowed by the umask
        _fill(fd, lim)
        try:
            os.link(tmp, p)
        except FileExistsError:
            return False
        return True
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def create_anonymous(limits: Mapping[int, int] | None = None) -> int:
    """A region in an inheritable memfd (no file on disk); returns its descriptor."""
    fd = os.memfd_create("vgpu-region", 0)
    try:
        _fill(fd, _check_limits(limits))
    except BaseException:
        os.close(fd)
        raise
    return fd

"""The slice accounting file (CUDA_DEVICE_MEMORY_SHARED_CACHE), read from Python.

The layout is shim/include/vgpu/region.h, seen through cffi (sharing._region_cffi); the protocol
is described there. This module opens a region read-only and takes consistent-enough snapshots
(without the lock, so it never blocks the shim; with pread into a private copy, never a
mapping: any process of the slice may truncate the file, and a mapping would fault; a word the
shim stores at that instant may read torn once), tells live processes from dead ones the way the
shim does (the slot's byte lock), and can create a region atomically (for the DRA driver, or
`vgpu run`).

The file holds usage only: any process of the slice can write it, so a slice's limits are never
kept here (they come from the plugin's read-only limits file, or the environment of `vgpu run`).
Files are opened the way the shim opens them (shim/src/safefile.c): never through a link at the
last component, relative to a directory that belongs to the caller or root and, if others may
write it, has the sticky bit; in such a directory only a file of the caller or root is used.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any

from sharing._region_cffi import ffi, lib

MAGIC: int = lib.VGPU_REGION_MAGIC
LAYOUT_VERSION: int = lib.VGPU_REGION_LAYOUT_VERSION
MAX_DEVICES: int = lib.VGPU_MAX_DEVICES
MAX_PROCS: int = lib.VGPU_MAX_PROCS
FILE_SIZE: int = ffi.sizeof("struct vgpu_region")
LIMITS_ENV: int = lib.VGPU_LIMITS_ENV
LIMITS_FILE: int = lib.VGPU_LIMITS_FILE
_PROCS_AT: int = ffi.offsetof("struct vgpu_region", "procs")
_HWM_AT: int = ffi.offsetof("struct vgpu_region", "slots_hwm")
_SLOT_SIZE: int = ffi.sizeof("struct vgpu_proc_slot")

# struct flock on Linux x86-64/aarch64: short l_type, short l_whence, off_t l_start, off_t l_len,
# pid_t l_pid (+ padding)
_FLOCK = "hhxxxxqqixxxx"


class RegionError(Exception):
    """The file is not a usable accounting region. str() is one line naming the file and why."""


@dataclass(frozen=True)
class DeviceUsage:
    index: int  # device index as the application sees it
    used: int  # bytes charged by live and not-yet-reclaimed processes
    peak: int
    denials: int
    denied_bytes: int = 0  # bytes asked for by the refused allocations
    # a context's device memory as the slice learned it (0: not yet); tenant-written
    context_bytes: int = 0


@dataclass(frozen=True)
class ComputeUsage:
    """One device's compute-gate counters (struct vgpu_compute_state), all cumulative."""

    index: int
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
class SlotLimits:
    """What a live slot's process says it enforces (tenant-written, like `used`)."""

    slot: int
    pid: int  # in the process's own PID namespace
    source: int  # LIMITS_ENV, LIMITS_FILE, 0 unknown
    dev: int  # the limits file it read (LIMITS_FILE)
    ino: int
    hash: int  # FNV-1a 64 of that file's bytes


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


_HEADER_FULL = struct.Struct("@IIQII")  # struct vgpu_region_header up to max_procs


def check_size(path: str, size: int) -> None:
    """RegionError unless `size` is the layout's file size."""
    if size != FILE_SIZE:
        raise RegionError(
            f"{path}: size {size} bytes, expected {FILE_SIZE} "
            f"(not a vgpu accounting file of layout {LAYOUT_VERSION})"
        )


def check_header(path: str, buf: bytes) -> None:
    """RegionError unless `buf` (the file's first bytes, as read) starts with this layout's
    header. The header is the tenant's to overwrite: it is checked at every read."""
    if len(buf) < _HEADER_FULL.size:
        raise RegionError(f"{path}: too short for a vgpu accounting file")
    magic, version, file_size, max_devices, max_procs = _HEADER_FULL.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RegionError(f"{path}: wrong magic {magic:#x} (not a vgpu accounting file)")
    if version != LAYOUT_VERSION:
        raise RegionError(f"{path}: layout version {version}, this reader knows {LAYOUT_VERSION}")
    if file_size != FILE_SIZE or max_devices != MAX_DEVICES or max_procs != MAX_PROCS:
        raise RegionError(f"{path}: header sizes disagree with layout {LAYOUT_VERSION}")


def _why(e: OSError) -> str:
    """One line for an open() error, as the shim says it."""
    if e.errno == errno.ELOOP:
        return "is a symbolic link (refused: it could point anywhere)"
    if e.errno == errno.EISDIR:
        return "is a directory"
    if e.errno == errno.ENOENT:
        return "does not exist"
    return e.strerror or str(e)


def open_dir(path: str | os.PathLike[str]) -> tuple[int, str, bool]:
    """The checked directory of `path` (fd), its last component, and whether others may write it.

    Links in the directory's own path are followed (an admin's choice, like /var/run); the
    directory must belong to the caller or root, and have the sticky bit if others may write it.
    """
    p = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(p)
    if not name or name in (".", ".."):
        raise RegionError(f"{p}: not a file path")
    try:
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise RegionError(f"{p}: its directory {parent} {_why(e)}") from e
    st = os.fstat(dfd)
    why = None
    if st.st_uid not in (os.geteuid(), 0):
        why = f"its directory {parent} belongs to uid {st.st_uid}, neither this user nor root"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        why = (
            f"its directory {parent} is writable by others without the sticky bit "
            f"(mode {stat.S_IMODE(st.st_mode):04o})"
        )
    if why:
        os.close(dfd)
        raise RegionError(f"{p}: {why}")
    return dfd, name, bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _check_file(p: str, fd: int, shared: bool) -> os.stat_result:
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise RegionError(f"{p}: is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"{p}: is not a regular file")
    if shared and st.st_uid not in (os.geteuid(), 0):
        raise RegionError(
            f"{p}: belongs to uid {st.st_uid} in a directory others can write "
            "(refused: it could be planted)"
        )
    return st


def _open_for_reading(p: str) -> int:
    """A descriptor to read the file at p through (never a link at its last component, never
    blocking on a FIFO), or RegionError in one line."""
    try:
        return os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise RegionError(f"{p}: {_why(e)}") from e


def read(path: str | os.PathLike[str]) -> RegionSnapshot:
    """Snapshot the region at path. Raises RegionError (one line) if it is missing or not valid.

    The file is read with pread into a private copy, never mapped: a file truncated while it is
    read (any process of the slice may do it) is a RegionError, not a SIGBUS."""
    p = os.fspath(path)
    fd = _open_for_reading(p)
    try:
        size = _check_file(p, fd, False).st_size
        if size != FILE_SIZE:
            _check_header_version(p, fd, size)
            check_size(p, size)
        try:
            buf = os.pread(fd, FILE_SIZE + 1, 0)
        except OSError as e:
            raise RegionError(f"{p}: cannot read: {e.strerror or e}") from e
        check_size(p, len(buf))  # changed size between the fstat and the read
        check_header(p, buf)
        r = ffi.cast("struct vgpu_region *", ffi.from_buffer(buf))
        devices = tuple(
            DeviceUsage(
                index=d,
                used=int(r.devices[d].used),
                peak=int(r.devices[d].peak),
                denials=int(r.devices[d].denials),
                denied_bytes=int(r.devices[d].denied_bytes),
                context_bytes=_learned_context(r.devices[d]),
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
        return RegionSnapshot(
            path=p,
            layout_version=int(r.header.layout_version),
            devices=devices,
            processes=procs,
            lock_recoveries=int(r.lock_recoveries),
            reclaimed_slots=int(r.reclaimed_slots),
            compute=compute,
        )
    finally:
        os.close(fd)


def _learned_context(account: Any) -> int:
    """A device's learned context size: its bytes when measured (region.h), else 0."""
    measured = (lib.VGPU_CONTEXT_DEVICE, lib.VGPU_CONTEXT_EXACT)
    return int(account.context_bytes) if account.context_source in measured else 0


def _compute_usage(index: int, st: Any) -> ComputeUsage:
    return ComputeUsage(
        index=index,
        launches=int(st.launches),
        charged_ns=max(0, int(st.charged_ns)),  # corrections may briefly undershoot
        throttled=int(st.throttled),
        wait_ns=int(st.wait_ns),
    )


def _fill(fd: int) -> None:
    os.ftruncate(fd, FILE_SIZE)
    with mmap.mmap(fd, FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        r = ffi.cast("struct vgpu_region *", ffi.from_buffer(m))
        rc = lib.vgpu_region_init(r)  # the shim's own code (shim/src/region_init.c)
        del r
    if rc != 0:
        raise RegionError("cannot initialise the region")


def create(path: str | os.PathLike[str], mode: int | None = None) -> bool:
    """Create the region at path atomically (built in a temp file, then link()ed into place).

    Returns True if this call created it, False if it already existed (it is then left as is;
    validate it with read()). `mode`: the file's permissions exactly (e.g. 0o666 for processes
    of several users); None: 0o666 narrowed by the umask, as the shim creates it. Raises
    RegionError (one line) for a directory that is not safe to create in (see open_dir).
    """
    p = os.path.abspath(os.fspath(path))
    dfd, name, shared = open_dir(p)
    try:
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
            )
        except FileNotFoundError:
            pass
        except OSError as e:
            raise RegionError(f"{p}: {_why(e)}") from e
        else:
            try:
                _check_file(p, fd, shared)
            finally:
                os.close(fd)
            return False
        tmp = f".{name[:200]}.tmp.{os.getpid()}.{time.monotonic_ns()}"
        fd = os.open(
            tmp,
            os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o666,
            dir_fd=dfd,
        )
        try:
            if mode is not None:
                os.fchmod(fd, mode)  # our own new file: exactly as asked, not narrowed by the umask
            _fill(fd)
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                return False
            return True
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
    finally:
        os.close(dfd)


def create_anonymous() -> int:
    """A region in an inheritable memfd (no file on disk); returns its descriptor."""
    fd = os.memfd_create("vgpu-region", 0)
    try:
        _fill(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_slot_limits(path: str | os.PathLike[str]) -> list[SlotLimits]:
    """The live slots' published limits, read with pread (never a mapping: another party can
    truncate the file, and a read past its end is a short read, not a fault). RegionError (one
    line) for a file that is missing, of another layout or size, or being truncated."""
    p = os.fspath(path)
    fd = _open_for_reading(p)
    try:
        st = os.fstat(fd)
        head = os.pread(fd, ffi.sizeof("struct vgpu_region_header"), 0)
        if not stat.S_ISREG(st.st_mode) or st.st_size != FILE_SIZE or len(head) < 8:
            raise RegionError(f"{p}: not an accounting file of {FILE_SIZE} bytes")
        magic, version = struct.unpack_from("=II", head)
        if magic != MAGIC or version != LAYOUT_VERSION:
            raise RegionError(f"{p}: layout version {version}, this reader knows {LAYOUT_VERSION}")
        hwm_raw = os.pread(fd, 4, _HWM_AT)
        hwm = min(struct.unpack("=I", hwm_raw)[0] if len(hwm_raw) == 4 else 0, MAX_PROCS)
        data = os.pread(fd, hwm * _SLOT_SIZE, _PROCS_AT)
        if len(data) != hwm * _SLOT_SIZE:
            raise RegionError(f"{p}: shorter than its slots (being truncated?)")
        buf = ffi.from_buffer(data)
        slots = ffi.cast("struct vgpu_proc_slot *", buf)
        out = []
        for i in range(hwm):
            s = slots[i]
            if s.state == lib.VGPU_SLOT_LIVE and _slot_alive(fd, i):
                out.append(SlotLimits(i, int(s.pid), int(s.limits_source), int(s.limits_dev),
                                      int(s.limits_ino), int(s.limits_hash)))  # fmt: skip
        del slots, buf  # the cffi views go before the bytes they point into
        return out
    except OSError as e:
        raise RegionError(f"{p}: {_why(e)}") from e
    finally:
        os.close(fd)

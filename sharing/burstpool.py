"""The burst pool file (docs/policy.md, "Memory that bursts and is given back"): the plugin's node-wide
file of per-device pools and per-(claim, device) grants that bursting slices read (read-only) at
every allocation above their request.

Layout: `struct vgpu_pool` in shim/include/vgpu/region.h (its own VGPU_POOL_LAYOUT_VERSION). Every
entry is written and read under its sequence number by the shim's own code (shim/src/pool_io.c,
compiled into the cffi binding): the plugin writes with the code the shim reads with.

The file is created complete (built under a temporary name, then renamed into place) and is then
only ever updated in place: a read-only bind mount of it (the claim's containers') sees every
change. One writer at a time: the caller serialises writes (the plugin holds its state lock).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from sharing._region_cffi import ffi, lib

FILE_SIZE: int = ffi.sizeof("struct vgpu_pool")
MAX_GRANTS: int = lib.VGPU_POOL_MAX_GRANTS
MAX_DEVICES: int = lib.VGPU_MAX_DEVICES
GRANT_FREE: int = lib.VGPU_GRANT_FREE
GRANT_OPEN: int = lib.VGPU_GRANT_OPEN
GRANT_RECLAIM: int = lib.VGPU_GRANT_RECLAIM
_WHY = 160


class PoolFileError(ValueError):
    """A file that is not a pool file of this layout. str() is one line."""


@dataclass(frozen=True)
class Grant:
    """One grant entry as read (a consistent copy)."""

    key: int
    device: int
    state: int
    request: int
    limit: int
    grant: int
    deadline_unix_ns: int


def create(path: str | os.PathLike[str], mode: int = 0o644) -> None:
    """A new, empty pool file at path (replacing none: FileExistsError if one is there)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.ftruncate(fd, FILE_SIZE)
        with mmap.mmap(fd, FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            lib.vgpu_pool_init(ffi.cast("struct vgpu_pool *", ffi.from_buffer(m)))
        os.fchmod(fd, mode)
        os.fsync(fd)
        os.link(tmp, p)  # never over an existing file
    finally:
        os.close(fd)
        os.unlink(tmp)


def create_anonymous() -> int:
    """A new, empty pool file in a memfd (`vgpu run`: CMD inherits it and the shim reads it as
    /proc/<pid>/fd/<n>). Returns the descriptor (close-on-exec: the caller decides)."""
    fd = os.memfd_create("vgpu-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, FILE_SIZE)
        with mmap.mmap(fd, FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            lib.vgpu_pool_init(ffi.cast("struct vgpu_pool *", ffi.from_buffer(m)))
    except OSError:
        os.close(fd)
        raise
    return fd


class Pool:
    """An open pool file: read-write for the plugin (and tests), read-only for observers."""

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, fd: int | None = None,
        writable: bool = False,
    ) -> None:  # fmt: skip
        """The file at path (never through a link), or the open file fd (dup'ed: the caller keeps
        its own)."""
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
        if (path is None) == (fd is None):
            raise ValueError("Pool: give a path or an fd")
        fd = os.open(path, flags) if path is not None else os.dup(fd)  # type: ignore[arg-type]
        try:
            size = os.fstat(fd).st_size
            if size != FILE_SIZE:
                raise PoolFileError(f"{path}: size {size} bytes, expected {FILE_SIZE}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._map = mmap.mmap(fd, FILE_SIZE, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self._writable = writable
        # a read-only mapping is fine for reads: cffi does not require a writable buffer
        self._p: Any = ffi.cast("struct vgpu_pool *", ffi.from_buffer(self._map))
        why = ffi.new("char[]", _WHY)
        if lib.vgpu_pool_check(self._p, FILE_SIZE, why, _WHY) != 0:
            self.close()
            raise PoolFileError(f"{path}: {ffi.string(why).decode('ascii', 'replace')}")

    def close(self) -> None:
        self._p = None
        self._map.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def write_grant(
        self,
        index: int,
        *,
        key: int,
        device: int,
        state: int,
        request: int,
        limit: int,
        grant: int,
        deadline_unix_ns: int = 0,
    ) -> None:
        """Rewrite grant entry index (key 0 and GRANT_FREE: a free entry). After it returns
        (a full fence), a reader that starts a read sees the new entry."""
        if not self._writable:
            raise PoolFileError("pool file opened read-only")
        if not 0 <= index < MAX_GRANTS:
            raise PoolFileError(f"grant entry {index} outside 0..{MAX_GRANTS - 1}")
        lib.vgpu_pool_grant_write(
            ffi.addressof(self._p.grants[index]),
            key, device, state, request, limit, grant, deadline_unix_ns,
        )  # fmt: skip

    def free_grant(self, index: int) -> None:
        self.write_grant(index, key=0, device=0, state=GRANT_FREE, request=0, limit=0, grant=0)

    def write_device(
        self, device: int, *, capacity: int, reserved: int, requested: int, pool: int, granted: int
    ) -> None:
        if not self._writable:
            raise PoolFileError("pool file opened read-only")
        lib.vgpu_pool_device_write(
            ffi.addressof(self._p.devices[device]), capacity, reserved, requested, pool, granted
        )

    def read_grant(self, index: int) -> Grant | None:
        """Entry index as one consistent copy, or None if a writer held it through every try."""
        out = ffi.new("struct vgpu_pool_grant *")
        if not 0 <= index < MAX_GRANTS:
            raise PoolFileError(f"grant entry {index} outside 0..{MAX_GRANTS - 1}")
        if lib.vgpu_pool_grant_read(ffi.addressof(self._p.grants[index]), out) != 0:
            return None
        return Grant(
            key=out.key,
            device=out.device,
            state=out.state,
            request=out.request,
            limit=out.limit,
            grant=out.grant,
            deadline_unix_ns=out.deadline_unix_ns,
        )

    def read_device(self, device: int) -> tuple[int, int, int, int, int] | None:
        """Device entry `device` as (capacity, reserved, requested, pool, granted), one consistent
        copy under its sequence number, or None if a writer held it through every try."""
        if not 0 <= device < MAX_DEVICES:
            raise PoolFileError(f"device entry {device} outside 0..{MAX_DEVICES - 1}")
        d = self._p.devices[device]
        for _ in range(1000):
            before = d.seq
            fields = (d.capacity, d.reserved, d.requested, d.pool, d.granted)
            if before % 2 == 0 and d.seq == before:
                return fields
        return None

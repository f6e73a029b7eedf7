"""The burst pool file from Python (sharing/burstpool.py): the plugin's writer and an observer's
reader, with the shim's own entry code (tests/shim/test_burst.py runs the shim against it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sharing import burstpool


def test_a_reader_sees_each_write_of_the_writer_in_place(tmp_path: Path) -> None:
    path = tmp_path / "pool"
    burstpool.create(path)
    ino = path.stat().st_ino
    with burstpool.Pool(path) as reader, burstpool.Pool(path, writable=True) as writer:
        assert reader.read_grant(7) == burstpool.Grant(0, 0, burstpool.GRANT_FREE, 0, 0, 0, 0)
        writer.write_grant(7, key=9, device=1, state=burstpool.GRANT_OPEN, request=1, limit=3,
                           grant=2)  # fmt: skip
        assert reader.read_grant(7) == burstpool.Grant(9, 1, burstpool.GRANT_OPEN, 1, 3, 2, 0)
        writer.write_grant(7, key=9, device=1, state=burstpool.GRANT_RECLAIM, request=1, limit=3,
                           grant=0, deadline_unix_ns=5)  # fmt: skip
        assert reader.read_grant(7) == burstpool.Grant(9, 1, burstpool.GRANT_RECLAIM, 1, 3, 0, 5)
        writer.free_grant(7)
        assert reader.read_grant(7) == burstpool.Grant(0, 0, burstpool.GRANT_FREE, 0, 0, 0, 0)
    assert path.stat().st_ino == ino  # updated in place: a bind mount of it sees the changes


def test_what_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pool"
    burstpool.create(path)
    with pytest.raises(FileExistsError):
        burstpool.create(path)  # never over an existing file
    with burstpool.Pool(path) as reader, pytest.raises(burstpool.PoolFileError, match="read-only"):
        reader.free_grant(0)
    with burstpool.Pool(path, writable=True) as writer:
        for bad in (-1, burstpool.MAX_GRANTS):
            with pytest.raises(burstpool.PoolFileError, match="outside"):
                writer.free_grant(bad)
    other = tmp_path / "zeros"
    other.write_bytes(bytes(burstpool.FILE_SIZE))
    with pytest.raises(burstpool.PoolFileError, match="magic"):
        burstpool.Pool(other)
    other.write_bytes(b"x")
    with pytest.raises(burstpool.PoolFileError, match="size"):
        burstpool.Pool(other)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(OSError):
        burstpool.Pool(link)  # never through a link


def test_an_anonymous_pool_is_a_pool(tmp_path: Path) -> None:
    fd = burstpool.create_anonymous()
    try:
        with burstpool.Pool(fd=fd, writable=True) as p:
            p.write_grant(0, key=1, device=0, state=burstpool.GRANT_OPEN, request=1, limit=2,
                          grant=1)  # fmt: skip
        with burstpool.Pool(fd=fd) as p:
            assert p.read_grant(0) == burstpool.Grant(1, 0, burstpool.GRANT_OPEN, 1, 2, 1, 0)
    finally:
        os.close(fd)

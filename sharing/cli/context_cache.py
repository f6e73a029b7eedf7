"""`vgpu run`'s per-user cache of what a CUDA context takes on each GPU model, so that a run's
first process can be handed the size (VGPU_CONTEXT_SIZE, docs/shim.md *Contexts*) instead of
measuring it through NVML on its start-up path.

    $XDG_CACHE_HOME/vgpu-sharing/context-sizes.json   (default ~/.cache/...)
    {"<GPU name> / <memory bytes> B / driver <version>": <bytes>, ...}

Learned from a `--region FILE` slice whose processes measured a context through NVML (the slice's
learned size, region.h): the driver's figure for that model and driver version, so it holds for
every run of this user on such a GPU. It is only a hint: the shim verifies it
against the driver and charges the driver's figure where that is more.

The cache is believed only when nobody else can have written it: the directory and the file owned
by this user, neither group- nor other-writable, neither a symbolic link, the file a regular file
with one link, read through descriptors that follow no link. Anything else is ignored with one
line on stderr (CacheUntrusted), never read.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sharing.fsutil import atomic_write

log = logging.getLogger(__name__)

FILE_NAME = "context-sizes.json"
MAX_BYTES = 64 * 1024  # far above any real cache (one entry per GPU model and driver)
MAX_SIZE = 1 << 50  # larger than any GPU's memory: not a context size


class CacheUntrusted(Exception):
    """The cache (or its directory) could have been written by someone else. str() is one line."""


@dataclass(frozen=True)
class ContextCache:
    path: Path

    @classmethod
    def for_user(cls, env: Mapping[str, str]) -> ContextCache:
        base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return cls(Path(base) / "vgpu-sharing" / FILE_NAME)

    def read(self) -> dict[str, int]:
        """The cached sizes; {} when there is no cache. CacheUntrusted when it is not ours."""
        try:
            dfd = _open_dir(self.path.parent)
        except FileNotFoundError:
            return {}
        try:
            try:
                fd = os.open(self.path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                return {}
            except OSError as e:  # ELOOP: a link
                raise CacheUntrusted(
                    f"{self.path}: cannot open without following links ({e.strerror})"
                ) from e
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                _check_owned(self.path, st, want_dir=False)
                data = f.read(MAX_BYTES + 1)
        finally:
            os.close(dfd)
        if len(data) > MAX_BYTES:
            raise CacheUntrusted(f"{self.path}: larger than {MAX_BYTES} bytes")
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise CacheUntrusted(f"{self.path}: not JSON ({e})") from e
        if not isinstance(doc, dict):
            raise CacheUntrusted(f"{self.path}: not a JSON object of sizes")
        return {
            k: v
            for k, v in doc.items()
            if isinstance(k, str) and type(v) is int and 0 < v < MAX_SIZE
        }

    def remember(self, key: str, size: int) -> None:
        """Store one model's size (the directory made private first). CacheUntrusted as read."""
        if not 0 < size < MAX_SIZE:
            return
        sizes = self.read()
        if sizes.get(key) == size:
            return
        sizes[key] = size
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(_open_dir(self.path.parent))  # checked before anything is written into it
        atomic_write(self.path, json.dumps(sizes, indent=1, sort_keys=True).encode(), mode=0o600)
        log.debug("context size of %s: %d bytes cached in %s", key, size, self.path)


def model_key(name: str, memory_total: int, driver_version: str) -> str:
    """The cache's key: what decides a context's size (model, memory, driver)."""
    return f"{name} / {memory_total} B / driver {driver_version}"


def _open_dir(path: Path) -> int:
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP / ENOTDIR: a link or not a directory
        raise CacheUntrusted(
            f"{path}: not a directory reachable without links ({e.strerror})"
        ) from e
    try:
        _check_owned(path, os.fstat(dfd), want_dir=True)
    except BaseException:
        os.close(dfd)
        raise
    return dfd


def _check_owned(path: Path, st: os.stat_result, *, want_dir: bool) -> None:
    kind_ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise CacheUntrusted(f"{path}: not a {'directory' if want_dir else 'regular file'}")
    if st.st_uid != os.geteuid():
        raise CacheUntrusted(f"{path}: owned by uid {st.st_uid}, not this user ({os.geteuid()})")
    if st.st_mode & 0o022:
        raise CacheUntrusted(f"{path}: writable by group or others (mode {st.st_mode & 0o777:o})")
    if not want_dir and st.st_nlink != 1:
        raise CacheUntrusted(f"{path}: has {st.st_nlink} links")

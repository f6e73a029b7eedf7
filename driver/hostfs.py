"""File operations of the plugin under its own directories, none of which follows a link.

The plugin runs as root and works in directories whose parts are reachable by tenants (a claim's
`shared/` directory is mounted writable into its containers). A root process that opens, chmods
or deletes through a link planted there acts on the link's target: any file on the host. So:

- every file is created with O_CREAT|O_EXCL|O_NOFOLLOW, relative to a directory descriptor, and
  only a file created in that same call is ever fchmod'ed;
- a deletion names a directory the plugin owns (`root`) and a single entry in it; the directory
  is resolved and must be inside `root`, the entry is removed relative to its descriptor
  (unlinkat never follows a link; shutil.rmtree with dir_fd removes links inside a tree as
  links). A path outside the plugin's directories is refused, whatever a checkpoint says.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class OutsideError(OSError):
    """A path the plugin was asked to delete is not inside its own directories."""


def is_inside(path: Path, root: Path) -> bool:
    """Whether `path` names one entry of a directory that is (after resolving links) `root` or
    below it. The entry itself is not resolved: a link there is removed as a link."""
    if path.name in ("", ".", ".."):
        return False
    parent = Path(os.path.realpath(path.parent))
    top = Path(os.path.realpath(root))
    return parent == top or top in parent.parents


@contextlib.contextmanager
def open_dir(path: Path) -> Iterator[int]:
    """A descriptor of directory `path`; its last component must not be a link."""
    fd = os.open(path, _DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def _checked_parent(path: Path, root: Path) -> Path:
    if not is_inside(path, root):
        raise OutsideError(
            f"{path} is outside {root}: the plugin deletes only inside its own directories"
        )
    return Path(os.path.realpath(path.parent))


def remove(path: Path, root: Path) -> bool:
    """Remove the file, link or directory tree `path` (inside `root`) without following links.
    True if something was removed; False if nothing was there."""
    parent = _checked_parent(path, root)
    try:
        dfd = os.open(parent, _DIR_FLAGS)
    except FileNotFoundError:
        return False
    try:
        try:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path.name, dir_fd=dfd)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.name, dir_fd=dfd)
        os.fsync(dfd)
        return True
    finally:
        os.close(dfd)


def create_empty(dir_fd: int, name: str, mode: int) -> None:
    """Create the empty regular file `name` in the directory `dir_fd` and give it `mode`
    (exactly, not narrowed by the umask). FileExistsError when the name is taken, by anything
    (a link included: O_EXCL never follows one)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)  # fmt: skip
    try:
        os.fchmod(fd, mode)  # the file this call created, never another
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dir(dir_fd: int, name: str, mode: int) -> bool:
    """Create directory `name` in `dir_fd` with `mode` exactly; True if this call created it.
    An existing directory is kept as it is (not chmod'ed); an existing non-directory (a link
    included) is an error."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{name} exists and is not a directory") from None
        return False
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)  # the directory this call created
    finally:
        os.close(fd)
    return True


def read_file(path: Path) -> bytes:
    """The content of the regular file `path`, opened without following a link at its last
    component (ELOOP for a link). FileNotFoundError when absent."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def is_regular(dir_fd: int, name: str) -> bool:
    """Whether `name` in `dir_fd` is a regular file (a link to one is not)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode)


def is_real_dir(path: Path) -> bool:
    """Whether `path` is a directory and not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False

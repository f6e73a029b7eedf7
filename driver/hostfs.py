"""File operations of the plugin under its own directories, none of which follows a link.

The plugin runs as root and works in directories whose parts are reachable by tenants (a claim's
`shared/` directory is mounted writable into its containers). A root process that opens, chmods
or deletes through a link planted there acts on the link's target: any file on the host. So:

- every file is created with O_CREAT|O_EXCL|O_NOFOLLOW, relative to a directory descriptor, and
  only a file created in that same call is ever fchmod'ed;
- a deletion names a directory the plugin owns (`root`) and a single entry in it; the directory
  is resolved and must be inside `root`, the entry is removed relative to its descriptor
  (unlinkat never follows a link). A path outside the plugin's directories is refused, whatever
  a checkpoint says.
- a tree is removed by remove_tree(): iteratively (a tree of any depth: no recursion), holding
  at most three descriptors at a time, never following a link (each level is opened with
  O_NOFOLLOW relative to its parent, links are unlinked as links) and never leaving the tree:
  it goes back up through "..", checked to be the very directory it came from (device and
  inode), and it does not enter another file system (a mount point inside is an error).
- a tree a tenant could fill is first moved aside (move_aside: a rename into the plugin's trash
  directory, one system call, done under the plugin's lock) and removed afterwards, outside it.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import stat
import time
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
            try:
                remove_tree(dfd, path.name)
            except FileNotFoundError:
                if os.path.lexists(path):
                    raise  # a part went away under the removal: not the whole tree
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.name, dir_fd=dfd)
        os.fsync(dfd)
        return True
    finally:
        os.close(dfd)


class TreeChangedError(OSError):
    """A tree being removed was moved or replaced under the remover (it stops, never leaving it)."""


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def remove_tree(dir_fd: int, name: str) -> None:
    """Remove the directory `name` of `dir_fd` and everything below it, however deep or wide,
    with at most three descriptors open, never following a link and never leaving the tree.
    Entries that vanish meanwhile are skipped. TreeChangedError when a directory on the way is
    replaced or moved (nothing outside the tree is touched); OSError as the system says it."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    dev = _ident(fd)[0]
    path: list[tuple[str, tuple[int, int]]] = [(name, _ident(fd))]  # names and identities, top down
    try:
        while True:
            sub = None
            with os.scandir(fd) as it:  # a duplicate of fd, closed with the iterator
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        sub = e.name
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.name, dir_fd=fd)  # files, links, FIFOs, sockets: the entry
            if sub is not None:
                try:
                    nfd = os.open(sub, _DIR_FLAGS, dir_fd=fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue  # gone, or swapped for a non-directory: the next scan handles it
                except OSError as e:
                    if e.errno != errno.ELOOP:
                        raise
                    continue  # swapped for a link: unlinked as a link at the next scan
                ident = _ident(nfd)
                if ident[0] != dev:
                    os.close(nfd)
                    raise OSError(errno.EXDEV, f"{sub}: another file system mounted inside {name}")
                os.close(fd)
                fd = nfd
                path.append((sub, ident))
                continue
            if len(path) == 1:
                break
            up = os.open("..", _DIR_FLAGS, dir_fd=fd)
            child, _ = path.pop()
            if _ident(up) != path[-1][1]:
                os.close(up)
                raise TreeChangedError(
                    errno.ESTALE, f"{'/'.join(p for p, _ in path)}: moved while being removed"
                )
            os.close(fd)
            fd = up
            try:
                os.rmdir(child, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno != errno.ENOTEMPTY:  # filled meanwhile: scanned again
                    raise
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


_trash_names = itertools.count()


def move_aside(path: Path, root: Path, trash: Path) -> str | None:
    """Rename the entry `path` (inside `root`) into the directory `trash` (on the same file
    system, the plugin's own) under a new unique name, returned; None if nothing was there.
    One rename: the caller removes the moved tree later (remove(trash / name, trash))."""
    parent = _checked_parent(path, root)
    with open_dir(trash) as tfd:
        try:
            dfd = os.open(parent, _DIR_FLAGS)
        except FileNotFoundError:
            return None
        try:
            new = f"{path.name}.{time.time_ns()}.{next(_trash_names)}"
            try:
                os.rename(path.name, new, src_dir_fd=dfd, dst_dir_fd=tfd)
            except FileNotFoundError:
                return None
            os.fsync(dfd)
            os.fsync(tfd)
            return new
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

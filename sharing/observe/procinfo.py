"""Who a GPU process is, read from /proc: its start time and PID in its namespace, the files it
has mapped or open, the accounting file it names, its program interpreter, its read-only mounts
and its container.

Every one of these files is the tenant's to shape: a process can map 65,000 files with
4,000-character paths (a 240 MB /proc/<pid>/maps), hold a million descriptors, or mount 100,000
times in a mount namespace of its own. So every read here is bounded in bytes and entries and
streamed, keeping only the identities looked for: the plugin that runs this code as root must
never pay for the size of a tenant's files. A file past its bound raises TooLarge, and the
watchdog reports the process as too large to inspect (with enforcement on, it is stopped like a
process without the shim): a process nobody can inspect is a process nothing limits.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from sharing.logsafe import printable

# Bounds on what one process's files may cost a reader. A real workload is far below each
# (PyTorch with CUDA maps ~2,000 files in ~300 KB; a container has ~40 mounts); a tenant past
# one is reported, not read.
MAPS_BYTES = 16 << 20
MOUNTINFO_BYTES = 4 << 20
LINE_BYTES = 16 << 10  # the kernel's lines are shorter (a path is at most PATH_MAX)
ENVIRON_BYTES = 8 << 20  # execve caps a new program's environment at 6 MiB
SMALL_FILE_BYTES = 64 << 10  # stat, status, cgroup
OPEN_FILES = 16384  # descriptors looked at (each is one stat)
KEPT_SHIMS = 16  # libvgpu mappings kept from one map
PATH_KEPT = 4096  # bytes of a mapped path kept

REGION_ENV = b"CUDA_DEVICE_MEMORY_SHARED_CACHE="
SHIM_NAME = b"/libvgpu"  # the shim's file name as mapped (CONTAINER_LIB, sharing/_lib)
DELETED = b" (deleted)"


class TooLarge(Exception):
    """A process's /proc file is past the bound this module reads."""

    def __init__(self, pid: int, what: str, bound: str) -> None:
        super().__init__(f"its {what} is too large to inspect (over {bound})")
        self.pid = pid


def _mib(n: int) -> str:
    return f"{n >> 20} MiB"


def read_capped(path: str, cap: int) -> bytes | None:
    """The file's contents if they fit in `cap` bytes, else None (OSError as raised)."""
    with open(path, "rb", buffering=0) as f:
        data = bytearray()  # appended in place: no copy of what was read per chunk
        while len(data) <= cap:
            chunk = f.read(min(65536, cap + 1 - len(data)))
            if not chunk:
                return bytes(data)
            data += chunk
    return None


def _lines(path: str, cap: int, pid: int, what: str) -> Iterator[bytes]:
    """The file's lines, streamed; TooLarge once more than `cap` bytes have been read."""
    seen = 0
    with open(path, "rb", buffering=65536) as f:
        while line := f.readline(LINE_BYTES):
            seen += len(line)
            if seen > cap:
                raise TooLarge(pid, what, _mib(cap))
            yield line


def start_time(pid: int, proc_root: str = "/proc") -> int:
    """The process's start time in clock ticks after boot (field 22 of /proc/<pid>/stat); 0 if
    it is gone. With the PID it names one process: a PID reused later has another."""
    try:
        text = read_capped(f"{proc_root}/{pid}/stat", SMALL_FILE_BYTES) or b""
        return int(text[text.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def ns_pid(pid: int, proc_root: str = "/proc") -> int:
    """The process's PID in its own PID namespace (what the shim records in its slot)."""
    try:
        for line in _lines(f"{proc_root}/{pid}/status", SMALL_FILE_BYTES, pid, "status"):
            if line.startswith(b"NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError, TooLarge):
        pass
    return pid


@dataclass(frozen=True)
class MapsScan:
    """What one bounded pass over /proc/<pid>/maps found."""

    found: frozenset[tuple[int, int]]  # the wanted (st_dev, st_ino) that are mapped
    shims: tuple[tuple[int, int, bytes], ...]  # (st_dev, st_ino, path) of libvgpu mappings


def scan_maps(
    pid: int,
    proc_root: str = "/proc",
    want: frozenset[tuple[int, int]] | set[tuple[int, int]] = frozenset(),
) -> MapsScan:
    """One streamed pass over the process's memory map, keeping only the wanted identities and
    the libvgpu mappings. OSError (gone, not ours) or TooLarge."""
    found: set[tuple[int, int]] = set()
    shims: list[tuple[int, int, bytes]] = []
    inodes = {str(i).encode() for _, i in want}
    for line in _lines(f"{proc_root}/{pid}/maps", MAPS_BYTES, pid, "memory map"):
        parts = line.rstrip(b"\n").split(None, 5)
        if len(parts) < 5 or parts[4] == b"0":
            continue
        is_shim = len(parts) == 6 and SHIM_NAME in parts[5]
        if parts[4] not in inodes and not is_shim:
            continue
        major, _, minor = parts[3].partition(b":")
        try:
            ident = (os.makedev(int(major, 16), int(minor, 16)), int(parts[4]))
        except ValueError:
            continue
        if ident in want:
            found.add(ident)
        if is_shim and len(shims) < KEPT_SHIMS:
            shims.append((*ident, parts[5][:PATH_KEPT]))
    return MapsScan(frozenset(found), tuple(shims))


def open_file_among(
    pid: int, proc_root: str, want: Collection[tuple[int, int]]
) -> tuple[int, int] | None:
    """The first of the wanted (st_dev, st_ino) the process has open, None if none (or it is
    gone); TooLarge past OPEN_FILES descriptors. The descriptors are streamed, never listed."""
    try:
        it = os.scandir(f"{proc_root}/{pid}/fd")
    except OSError:
        return None
    with it:
        for n, entry in enumerate(it):
            if n >= OPEN_FILES:
                raise TooLarge(pid, "descriptor table", f"{OPEN_FILES} descriptors")
            try:
                st = os.stat(entry.path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in want:
                return (st.st_dev, st.st_ino)
    return None


# openat2(2): resolve a path as if the process's root were "/" (Linux 5.6)
_SYS_OPENAT2 = 437  # the same number on every architecture (asm-generic table)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_O_PATH = getattr(os, "O_PATH", 0o10000000)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def stat_in_root(root: str, path: bytes, follow: bool = False) -> os.stat_result:
    """lstat of `path` resolved strictly inside the directory `root` (a process's
    /proc/<pid>/root): absolute links and ".." stay inside it; the last component is followed
    only with `follow`. OSError when it cannot be reached (ENOSYS: a kernel without openat2)."""
    rfd = os.open(root, _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = _O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        how = _OpenHow(flags, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        fd = _libc.syscall(_SYS_OPENAT2, rfd, path, ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)
    finally:
        os.close(rfd)


@dataclass(frozen=True)
class Attribution:
    file_id: tuple[int, int] | None  # (st_dev, st_ino) of the accounting file it has or names
    ns_pid: int  # its PID in its own namespace (what the shim records in its slot)
    why: str  # when file_id is None: why it could not be attributed
    visible: bool = True  # False: we cannot look at the process (other PID namespace, no root)
    start: int = 0  # its start time (/proc/<pid>/stat, clock ticks after boot): its identity
    how: str = ""  # "mapped", "open" or "environment"
    maps: MapsScan | None = field(default=None, compare=False)  # the pass over its map, if read
    too_large: str = ""  # why a file of the process could not be inspected, "" if all could


def attribute(
    pid: int, proc_root: str = "/proc", known: Mapping[tuple[int, int], object] | None = None
) -> Attribution:
    """Which accounting file the process has (mapped, open) or else names, as its own root sees
    it. `known`: the slices' files by (st_dev, st_ino), looked for in its maps and descriptors."""
    npid = ns_pid(pid, proc_root)
    start = start_time(pid, proc_root)
    try:
        env = read_capped(f"{proc_root}/{pid}/environ", ENVIRON_BYTES)
    except (FileNotFoundError, PermissionError) as e:
        # not a violation: the watchdog is blind here (no hostPID, or not root)
        return Attribution(None, npid, f"cannot read its environment ({e.strerror})", False, start)
    except ProcessLookupError:
        # it exited after NVML listed it (a zombie's environment is gone): gone is no violation
        return Attribution(None, npid, "it has exited", False, start)
    except OSError as e:
        return Attribution(None, npid, f"cannot read its environment ({e.strerror})", True, start)
    too_large = "" if env is not None else str(TooLarge(pid, "environment", _mib(ENVIRON_BYTES)))
    scan = None
    if known:
        want = frozenset(known)
        try:
            scan = scan_maps(pid, proc_root, want)
            if scan.found:
                return Attribution(min(scan.found), npid, "", True, start, "mapped", scan)
        except TooLarge as e:
            too_large = too_large or str(e)
        except OSError:
            pass
        try:
            ident = open_file_among(pid, proc_root, want)
            if ident is not None:
                return Attribution(ident, npid, "", True, start, "open", scan, too_large)
        except TooLarge as e:
            too_large = too_large or str(e)
    path = None
    for item in (env or b"").split(b"\0"):
        if item.startswith(REGION_ENV):
            path = item[len(REGION_ENV) :]
    if not path or not path.startswith(b"/"):
        return Attribution(
            None, npid, too_large or "names no accounting file", True, start, "", scan, too_large
        )
    try:
        st = stat_in_root(f"{proc_root}/{pid}/root", path)
    except OSError as e:
        why = f"its accounting file {printable(path)} is unreachable inside its root ({e.strerror})"
        return Attribution(None, npid, why, True, start, "", scan, too_large)
    return Attribution(
        (st.st_dev, st.st_ino), npid, "", True, start, "environment", scan, too_large
    )


# ELF header layout per class: (e_phoff format and offset, e_phentsize offset, word format,
# offsets of p_offset and p_filesz in a program header)
_ELF = {1: ("I", 28, 42, "I", 4, 16), 2: ("Q", 32, 54, "Q", 8, 32)}
PT_INTERP = 3


def interpreter(pid: int, proc_root: str = "/proc") -> bytes | None:
    """The program interpreter (PT_INTERP) of the process's executable; b"" for a static
    binary; None if unreadable. Read from the ELF headers, not guessed from the memory map (a
    musl loader is mapped under its libc's name)."""
    try:
        with open(f"{proc_root}/{pid}/exe", "rb") as f:
            head = f.read(64)
            if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in _ELF:
                return None
            end = "<" if head[5] == 1 else ">"  # EI_DATA: 1 little-endian, 2 big-endian
            off_fmt, phoff_at, ph_at, word, p_offset_at, p_filesz_at = _ELF[head[4]]
            (phoff,) = struct.unpack_from(end + off_fmt, head, phoff_at)
            phentsize, phnum = struct.unpack_from(end + "HH", head, ph_at)
            if phentsize == 0:
                return None
            f.seek(phoff)
            table = f.read(phentsize * min(phnum, 256))
            for at in range(0, len(table) - phentsize + 1, phentsize):
                if struct.unpack_from(end + "I", table, at)[0] != PT_INTERP:
                    continue
                (off,) = struct.unpack_from(end + word, table, at + p_offset_at)
                (size,) = struct.unpack_from(end + word, table, at + p_filesz_at)
                f.seek(off)
                return f.read(min(size, 4096)).rstrip(b"\0")
            return b""
    except (OSError, struct.error):
        return None


def _unescape_mount_field(b: bytes) -> bytes:
    return (
        b.replace(b"\\040", b" ")
        .replace(b"\\011", b"\t")
        .replace(b"\\012", b"\n")
        .replace(b"\\134", b"\\")
    )


def has_ro_mount(pid: int, proc_root: str, wanted: set[tuple[int, bytes]]) -> bool:
    """Whether one of the (device, mount point) pairs is a read-only mount in the process's
    mount namespace. False when its mountinfo is unreadable; TooLarge past its bound."""
    try:
        for line in _lines(f"{proc_root}/{pid}/mountinfo", MOUNTINFO_BYTES, pid, "mount table"):
            parts = line.split()
            if len(parts) < 6 or not (parts[5] == b"ro" or parts[5].startswith(b"ro,")):
                continue
            major, _, minor = parts[2].partition(b":")
            try:
                dev = os.makedev(int(major), int(minor))
            except ValueError:
                continue
            if (dev, _unescape_mount_field(parts[4])) in wanted:
                return True
    except OSError:
        pass
    return False


def missing_shim(
    pid: int,
    proc_root: str = "/proc",
    genuine: set[tuple[int, int]] | None = None,
    scan: MapsScan | None = None,
) -> str | None:
    """None if the shim is mapped into the process (or we cannot tell); else why it is not.
    With `genuine` (the plugin's shim by device and inode) only that file counts as the shim:
    another file named libvgpu is a copy. The previous copy, replaced on the host by an upgrade,
    counts while the process's namespace still has it mounted read-only where it mapped it.
    `scan`: the pass over its map attribute() made, if any."""
    try:
        if scan is None:
            scan = scan_maps(pid, proc_root)
    except TooLarge as e:
        return str(e)
    except OSError:
        return None  # gone, or not ours to read: attribute() already said whether we are blind
    shims = scan.shims
    if genuine is not None and shims:
        if any((d, i) in genuine for d, i, _ in shims):
            return None
        devs = {d for d, _ in genuine}
        replaced = {
            (d, p[: -len(DELETED)]) for d, _, p in shims if p.endswith(DELETED) and d in devs
        }
        try:
            if replaced and has_ro_mount(pid, proc_root, replaced):
                return None
        except TooLarge as e:
            return str(e)
        where = printable(shims[0][2])
        return (
            f"the libvgpu it loaded ({where}) is not the plugin's shim (a copy, or another build)"
        )
    if shims:
        return None
    interp = interpreter(pid, proc_root)
    if interp is not None and b"musl" in interp:
        return "its C library is musl, whose loader never loads the shim (unsupported image)"
    if interp == b"":
        return "it is a static binary: no loader preloads the shim into it"
    return "the shim is not loaded into it (LD_PRELOAD cleared, or the loader refused it)"


def shim_limits_file(
    pid: int,
    proc_root: str,
    scan: MapsScan,
    genuine: set[tuple[int, int]],
    fallback: bytes,
) -> tuple[bytes, tuple[int, int]] | None:
    """The limits file the process's shim reads, as the process's own mount namespace resolves
    it (through /proc/<pid>/root): the file beside the plugin's shim it mapped, else `fallback`
    (the shim's order, shim/src/settings.c). (path, (st_dev, st_ino)); None if there is none
    or it cannot be looked at. A mount the tenant made over the plugin's file in a namespace of
    its own resolves to the tenant's file here: it has another identity than the claim's."""
    root = f"{proc_root}/{pid}/root"
    beside = [
        path.removesuffix(DELETED).rpartition(b"/")[0] + b"/limits"
        for d, i, path in scan.shims
        if (d, i) in genuine
    ]
    for path in [*beside[:1], fallback]:
        try:
            st = stat_in_root(root, path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            return None
        return path, (st.st_dev, st.st_ino)
    return None


# --- the container of a process ---------------------------------------------------------------

SHORT_ID = 12  # hex digits of a container ID shown, as container tools show them
# one path component naming a container (the innermost such component is the container's: podman
# may put the container's processes in a `container` leaf below it)
_CONTAINER = re.compile(r"(?:cri-containerd-|crio-|docker-|libpod-)?([0-9a-f]{64})(?:\.scope)?")
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD = re.compile(rf"pod({_UID})")
# the mount root of the kubelet's per-container file (terminationMessagePath), relative to its
# file system's root: /var/lib/kubelet/pods/... or /pods/... when the kubelet's root is a mount
_KUBELET_FILE = re.compile(
    rf"(?:^|/)pods/({_UID})/containers/([a-z0-9](?:[-a-z0-9]{{0,61}}[a-z0-9])?)/[^/]+"
)


@dataclass(frozen=True)
class Container:
    id: str  # the runtime's container ID, "" for a process in no container
    pod_uid: str  # the pod's UID from the kubelet's cgroup or mount names, "" when not under it
    name: str = ""  # the container's name in its pod (the kubelet's mounts), "" when unknown

    @property
    def short_id(self) -> str:
        return self.id[:SHORT_ID]


NO_CONTAINER = Container("", "")


def container_of_cgroup(text: str) -> Container:
    """The container a /proc/<pid>/cgroup file names (any hierarchy's path: v1 or v2)."""
    found = NO_CONTAINER
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        ids = [m.group(1) for part in path.split("/") if (m := _CONTAINER.fullmatch(part))]
        if not ids:
            continue
        pod = _POD.search(path)
        found = Container(ids[-1], pod.group(1).replace("_", "-") if pod else "")
        if found.pod_uid:
            break
    return found


def _kubelet_file_of(lines: Iterable[str]) -> tuple[str, str]:
    for line in lines:
        fields = line.split(" ", 4)
        if len(fields) == 5 and (m := _KUBELET_FILE.search(fields[3])):
            return m.group(1).replace("_", "-"), m.group(2)
    return "", ""


def kubelet_container_of_mountinfo(text: str) -> tuple[str, str]:
    """(pod UID, container name) of the kubelet's per-container file among the mounts of a
    /proc/<pid>/mountinfo, ("", "") when none is mounted."""
    return _kubelet_file_of(text.splitlines())


def container_of(pid: int, proc_root: str = "/proc") -> Container:
    """The container of a process (NO_CONTAINER when it is in none, or gone); a mount table past
    its bound names no container name."""
    try:
        raw = read_capped(f"{proc_root}/{pid}/cgroup", SMALL_FILE_BYTES)
    except OSError:
        return NO_CONTAINER
    if raw is None:
        return NO_CONTAINER
    c = container_of_cgroup(raw.decode("utf-8", "replace"))
    lines = _lines(f"{proc_root}/{pid}/mountinfo", MOUNTINFO_BYTES, pid, "mount table")
    try:
        pod_uid, name = _kubelet_file_of(x.decode("utf-8", "replace") for x in lines)
    except (OSError, TooLarge):
        return c
    if not name or (c.pod_uid and pod_uid != c.pod_uid):
        return c  # a pod's mounts that disagree with its cgroup name nothing
    return Container(c.id, pod_uid, name)

"""A GPU process of a claim that makes its /proc files as large as it can, run as a real
process: `python proc_attacker.py MODE DIR`. It creates a context and allocates on the
simulated GPU (so NVML lists it and the watchdog inspects it) after:

- maps: 58,000 one-page mappings of one file whose path is ~3,800 characters long (each mapping
  its own line of /proc/<pid>/maps, ~230 MB in all);
- fds: a million descriptors (RLIMIT_NOFILE raised to fit; to the hard limit without
  CAP_SYS_RESOURCE);
- mounts: 6,000 bind mounts on directories with ~3,000-character paths, in a mount namespace of
  its own (~18 MB of /proc/<pid>/mountinfo; a tenant could go on to 100,000 mounts, at a cost
  that grows with each mount);
- name: a process name with a newline in it, which would forge a line of the plugin's log.

It prints "ready <what>" when its files are that large, then waits to be killed. Needs root
(the test suite's machines are root; container root has what it needs for maps and fds)."""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

# Each mount costs the kernel more than the last (20,000 took 150 s here), so the mount table is
# made large with long mount points: 6,000 lines of ~3,100 bytes, ~18 MB.
MOUNTS = 6000


def _gpu() -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    dptr = ctypes.c_uint64()
    for call, args in (
        ("cuInit", (0,)),
        ("cuCtxCreate_v2", (ctypes.byref(ctx), 0, 0)),
        ("cuMemAlloc_v2", (ctypes.byref(dptr), ctypes.c_size_t(64 << 20))),
    ):
        rc = getattr(cuda, call)(*args)
        if rc != 0:
            sys.exit(f"{call} failed: CUresult {rc}")


def _long_dir(base: str, length: int) -> str:
    path = base
    while len(path) < length:
        path = os.path.join(path, "d" * min(200, length - len(path)))
    os.makedirs(path, exist_ok=True)
    return path


def maps(base: str) -> str:
    target = os.path.join(_long_dir(base, 3800), "f")
    with open(target, "wb") as f:
        f.truncate(mmap.PAGESIZE)
    fd = os.open(target, os.O_RDONLY)
    # libc's mmap: Python's mmap objects each keep a duplicate descriptor
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)  # fmt: skip
    n = 0
    for i in range(58000):  # below vm.max_map_count (65530), with room for the driver
        # alternate protections so the kernel cannot merge neighbouring mappings into one
        prot = mmap.PROT_READ if i % 2 else mmap.PROT_READ | mmap.PROT_EXEC
        if libc.mmap(None, mmap.PAGESIZE, prot, mmap.MAP_SHARED, fd, 0) in (None, 2**64 - 1):
            break
        n += 1
    return f"{n} mappings"


def fds(base: str) -> str:
    del base
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
    except (ValueError, OSError):  # no CAP_SYS_RESOURCE: up to the hard limit
        want = hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    fd = os.open("/dev/null", os.O_RDONLY)
    n = 0
    while n < want - 256:  # room for the driver's own files
        try:
            os.dup(fd)
        except OSError:
            break
        n += 1
    return f"{n} descriptors"


def mounts(base: str) -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_bind, ms_rec, ms_private = 0x00020000, 0x1000, 0x4000, 0x40000
    if libc.unshare(clone_newns) != 0:
        sys.exit(f"unshare: {os.strerror(ctypes.get_errno())}")
    # nothing of this namespace propagates back to the host's
    if libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
        sys.exit(f"mount private: {os.strerror(ctypes.get_errno())}")
    src = _long_dir(os.path.join(base, "src"), 50).encode()
    top = _long_dir(os.path.join(base, "p"), 3000)
    n = 0
    for i in range(MOUNTS):
        point = os.path.join(top, str(i))
        os.mkdir(point)
        if libc.mount(src, point.encode(), None, ms_bind, None) != 0:
            break  # fs.mount-max
        n += 1
    return f"{n} mounts"


def name(base: str) -> str:
    """A process name (argv[0]/comm is the tenant's) that would forge a log line."""
    del base
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_name = 15
    if libc.prctl(pr_set_name, FORGED_NAME.encode(), 0, 0, 0) != 0:
        sys.exit(f"prctl: {os.strerror(ctypes.get_errno())}")
    return "a forged name"


# 14 bytes: under comm's 15, so the name is read as it is
FORGED_NAME = "x\nWARNING forg"


def start_attacker(mode: str, base: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """This program as a process with `env`, returned once its files are that large."""
    p = subprocess.Popen(
        [sys.executable, __file__, mode, str(base)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()  # "ready ..." once its files are that large
    assert line.startswith("ready"), f"attacker failed: {line}{p.stdout.read()}"
    return p


def main() -> None:
    mode, base = sys.argv[1], sys.argv[2]
    # files first, then the context: the watchdog may stop a GPU process of the claim (it runs
    # without the shim) before a slow attack is in place
    what = {"maps": maps, "fds": fds, "mounts": mounts, "name": name}[mode](base)
    _gpu()
    print(f"ready {what}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()

"""What reading a tenant's accounting file with pread costs against mapping it.

    .venv/bin/python benchmarks/bench_counter_read.py [--slices 512] [--rounds 30]

The observers (exporter, watchdog, `vgpu top`) read every slice's counters with
sharing.counters.CounterReader: an fstat and up to two preads per slice and read, so that a file
its tenant truncates is an error, never a SIGBUS. The baseline, measured in the same run and
interleaved with it, is a reader that keeps each file mapped and reads the same words from the
mapping into the same result (what a mapping reader costs; it dies when a file is truncated
under it). Both are given the file's identity, as the exporter's slice finder gives it (no
lstat per read). Each file has
4 process slots in use (no live holder: the liveness check runs, as in bench_exporter.py).
Reported: the median and p90 time to read all slices once, per reader, and the ratio.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sharing._region_cffi import ffi, lib  # noqa: E402

from sharing import counters, region  # noqa: E402

_OFF = {name: ffi.offsetof("struct vgpu_region", name) for name in ("slots_hwm", "devices",
                                                                    "compute", "procs")}  # fmt: skip
_SLOT = ffi.sizeof("struct vgpu_proc_slot")
_COMPUTE = ffi.sizeof("struct vgpu_compute_state")
_ACCT = ffi.sizeof("struct vgpu_device_account")
_USED = ffi.offsetof("struct vgpu_proc_slot", "used")
_LAUNCHES = ffi.offsetof("struct vgpu_compute_state", "launches")
_CHARGED = ffi.offsetof("struct vgpu_compute_state", "charged_ns")
_WAIT = ffi.offsetof("struct vgpu_compute_state", "wait_ns")


class MappedReader:
    """The baseline: each file mapped once, the same words read from the mapping."""

    def __init__(self) -> None:
        self.maps: dict[str, tuple[int, mmap.mmap, os.stat_result]] = {}

    def read(self, path: str, n: int) -> counters.SliceCounters:
        """The same result as CounterReader.read, words read from the mapping."""
        entry = self.maps.get(path)
        if entry is None:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            m = mmap.mmap(fd, region.FILE_SIZE, prot=mmap.PROT_READ)
            entry = self.maps[path] = (fd, m, os.fstat(fd))
        fd, m, st = entry
        hwm = struct.unpack_from("@I", m, _OFF["slots_hwm"])[0]
        pids, charged = [], []
        for i in range(hwm):
            base = _OFF["procs"] + i * _SLOT
            pid, state = struct.unpack_from("@iI", m, base)
            if state == lib.VGPU_SLOT_LIVE and region._slot_alive(fd, i):
                pids.append(pid)
                charged.append(struct.unpack_from(f"@{n}Q", m, base + _USED))
        devices = []
        for d in range(n):
            used, peak, denials, denied = struct.unpack_from("@4Q", m, _OFF["devices"] + d * _ACCT)
            c = _OFF["compute"] + d * _COMPUTE
            devices.append(
                counters.DeviceCounters(
                    index=d,
                    used=min(used, sum(x[d] for x in charged)),
                    peak=peak,
                    denials=denials,
                    denied_bytes=denied,
                    launches=struct.unpack_from("@Q", m, c + _LAUNCHES)[0],
                    charged_ns=max(0, struct.unpack_from("@q", m, c + _CHARGED)[0]),
                    wait_ns=struct.unpack_from("@Q", m, c + _WAIT)[0],
                )
            )
        return counters.SliceCounters(
            path, st.st_dev, st.st_ino, tuple(devices), tuple(pids), tuple(charged)
        )

    def close(self) -> None:
        for fd, m, _ in self.maps.values():
            m.close()
            os.close(fd)


def _reader(
    name: str, idents: dict[str, tuple[int, int]]
) -> tuple[Callable[[str], object], Callable[[], None]]:
    if name.startswith("pread"):
        cr = counters.CounterReader()
        return (lambda p: cr.read(p, 1, idents[p])), cr.close
    mr = MappedReader()
    return (lambda p: mr.read(p, 1)), mr.close


def make_files(d: Path, n: int) -> list[str]:
    paths = []
    for i in range(n):
        p = d / f"slice-{i}"
        region.create(p)
        with open(p, "r+b") as f:  # 4 slots of processes that are gone
            f.seek(_OFF["slots_hwm"])
            f.write(struct.pack("@I", 4))
            for s in range(4):
                f.seek(_OFF["procs"] + s * _SLOT)
                f.write(struct.pack("@iI", 1000 + s, lib.VGPU_SLOT_LIVE))
        paths.append(str(p))
    return paths


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slices", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_files(Path(tmp), args.slices)
        idents = {p: (os.lstat(p).st_dev, os.lstat(p).st_ino) for p in paths}
        times: dict[str, list[float]] = {"pread (CounterReader)": [], "mapped (baseline)": []}
        for _ in range(5):  # interleaved: load on the machine hits both alike
            for name in times:
                read, close = _reader(name, idents)
                for p in paths:
                    read(p)  # open (and map) once, as the exporter keeps them
                for _ in range(args.rounds):
                    t = time.perf_counter()
                    for p in paths:
                        read(p)
                    times[name].append(time.perf_counter() - t)
                close()
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        p90 = sorted(v)[int(len(v) * 0.9)]
        print(f"{k:22s} median {med[k] * 1e3:6.2f} ms  p90 {p90 * 1e3:6.2f} ms  "
              f"per {args.slices} slices")  # fmt: skip
    ratio = med["pread (CounterReader)"] / med["mapped (baseline)"]
    print(f"ratio pread/mapped (median): x{ratio:.2f}; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Instruction counts of a framework's loop under callgrind, shared by the framework benchmarks.

The program under test switches callgrind's instrumentation on for the loop only (cg_start() and
cg_stop() of benchmarks/c/callgrind_toggle.c, built here as a library it loads with ctypes), so
the framework's start-up runs uninstrumented; with `--separate-threads=yes` each thread has a
profile of its own, and the main thread (the one that calls CUDA, where the shim's hooks run) is
the first.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

TOGGLE_C = Path(__file__).resolve().parent / "c" / "callgrind_toggle.c"


def need_tools() -> None:
    for tool in ("valgrind", "callgrind_annotate", "gcc"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} not found: the instruction count needs valgrind and gcc")


def wrapper(profile: Path) -> list[str]:
    """The command prefix that runs a program under callgrind, instrumented only when it asks."""
    return [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
        f"--callgrind-out-file={profile}",
    ]  # fmt: skip


def build_toggle(out_dir: Path) -> Path:
    """benchmarks/c/callgrind_toggle.c as a library for ctypes: cg_start(), cg_stop()."""
    lib = out_dir / "libcallgrind_toggle.so"
    cc = ["gcc", "-O1", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared"]
    subprocess.run([*cc, "-o", str(lib), str(TOGGLE_C)], check=True)
    return lib


def thread_profiles(profile: Path) -> list[Path]:
    """The per-thread profiles of one run (`-01` is the main thread)."""
    return sorted(profile.parent.glob(f"{profile.name}-*"))


def thread_totals(profile: Path) -> list[int]:
    """Instructions per thread of a callgrind run with --separate-threads=yes (main first)."""
    totals = []
    for f in thread_profiles(profile):
        # the header's summary line is 0 after CALLGRIND_ZERO_STATS: read the totals
        m = re.search(r"^totals:\s+(\d+)", f.read_text(), re.M)
        totals.append(int(m.group(1)) if m else 0)
    return totals


def callgrind_objects(path: Path) -> dict[str, int]:
    """Exclusive instructions per shared object of one callgrind profile."""
    cmd = ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    objects: dict[str, int] = {}
    for m in re.finditer(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+\S.*\[(\S+)\]\s*$", out, re.M):
        obj = Path(m.group(2)).name
        objects[obj] = objects.get(obj, 0) + int(m.group(1).replace(",", ""))
    return objects


def summary(profile: Path, per: int) -> dict[str, float]:
    """Instructions per unit of work (`per` units measured): of all threads, of the main
    thread, of libvgpu.so's own code and of the simulated driver's."""
    totals = thread_totals(profile)
    if not totals or not totals[0]:
        raise SystemExit(f"callgrind counted nothing in {thread_profiles(profile)}")
    objects: dict[str, int] = {}
    for f in thread_profiles(profile):
        for obj, n in callgrind_objects(f).items():
            objects[obj] = objects.get(obj, 0) + n
    return {
        "all": sum(totals) / per,
        "main": totals[0] / per,
        "shim": objects.get("libvgpu.so", 0) / per,
        "sim": objects.get("libcuda.so.1", 0) / per,
        "threads": len(totals),
    }

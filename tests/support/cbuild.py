"""Compile small C test programs against the project's CUDA declarations and the simulator."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from sharing.paths import sim_lib_dir

REPO = Path(__file__).resolve().parents[2]
INCLUDE = REPO / "shim" / "include"
C_PROGRAMS = REPO / "tests" / "c"

CFLAGS = ["-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread"]


def compile_program(source: Path | str, out_dir: Path, extra: list[str] | None = None) -> Path:
    """Build one C program linked against the simulated libcuda (as a CUDA app links libcuda).

    `source` is a path, or a file name under tests/c/. The binary is cached in out_dir by content.
    """
    src = Path(source)
    if not src.is_absolute():
        src = C_PROGRAMS / src
    flags = [*CFLAGS, *(extra or [])]
    key = hashlib.sha256(src.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    out = out_dir / f"{src.stem}-{key}"
    if out.exists():
        return out
    libdir = sim_lib_dir()
    cmd = [
        "gcc",
        *flags,
        f"-I{INCLUDE}",
        "-o",
        str(out),
        str(src),
        f"-L{libdir}",
        "-l:libcuda.so.1",
        "-ldl",
        "-lm",
    ]
    subprocess.run(cmd, check=True)
    return out


def compile_shared_library(
    source: Path | str, out_dir: Path, soname: str, extra: list[str] | None = None
) -> Path:
    """Build one C shared library (out_dir/<soname>) that needs the simulated libcuda.so.1 and
    libnvidia-ml.so.1, as a CUDA library does (kept as dependencies even if unreferenced)."""
    src = Path(source)
    if not src.is_absolute():
        src = C_PROGRAMS / src
    flags = [*CFLAGS, "-fPIC", "-shared", *(extra or [])]
    key = hashlib.sha256(src.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    out = out_dir / f"lib-{key}" / soname
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    libdir = sim_lib_dir()
    cmd = [
        "gcc", *flags, f"-I{INCLUDE}", f"-Wl,-soname,{soname}", "-o", str(out), str(src),
        f"-L{libdir}", "-Wl,--no-as-needed", "-l:libcuda.so.1", "-l:libnvidia-ml.so.1", "-ldl",
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    return out

"""What the C build produces.

One description shared by setup.py (the normal build, through setuptools' compiler) and by
the tests (sanitizer builds with gcc), so the two can never disagree on sources or flags.
Every ``*.c`` file in a library's source directories is part of that library.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = SHIM_DIR / "include"

# Warnings are errors: the shim runs inside other people's programs.
CFLAGS: tuple[str, ...] = (
    "-std=gnu11",
    "-O2",
    "-g",
    "-fPIC",
    "-pthread",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
)

SANITIZER_FLAGS: tuple[str, ...] = (
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=undefined",
    "-fno-omit-frame-pointer",
)


@dataclass(frozen=True)
class Library:
    """One plain C shared library (no libpython)."""

    filename: str  # file name written, e.g. "libcuda.so.1"
    subdir: str  # directory under sharing/_lib ("" or "sim")
    source_dirs: tuple[str, ...]  # relative to shim/
    soname: str
    libs: tuple[str, ...]
    cflags: tuple[str, ...] = ()  # this library's own, after CFLAGS
    needed: tuple[str, ...] = ()  # sonames kept in DT_NEEDED even where nothing binds to them
    bind_now: bool = True  # -z now (every import bound at load) or -z lazy (at its first call)
    as_needed: bool = False  # --as-needed for what the compiler adds (-pthread's libpthread)

    def sources(self) -> list[Path]:
        found: list[Path] = []
        for d in self.source_dirs:
            found.extend(sorted((SHIM_DIR / d).glob("*.c")))
        return found

    def output_path(self, lib_root: Path) -> Path:
        """Where this library goes under a build's library root (sharing/_lib or a test dir)."""
        return lib_root / self.subdir / self.filename

    def headers(self) -> list[Path]:
        hs = sorted([*INCLUDE_DIR.rglob("*.h"), *INCLUDE_DIR.rglob("*.def")])
        for d in self.source_dirs:
            hs.extend(sorted((SHIM_DIR / d).glob("*.h")))
        return hs


LIBRARIES: tuple[Library, ...] = (
    # The interposer every process of a sharing container loads. It binds to the oldest glibc
    # symbol versions (src/glibc_compat.h, force-included) so it loads on glibc >= 2.17. Before
    # 2.34 some dl* and pthread_* calls lived in libdl.so.2 and libpthread.so.0: src/compat.c
    # finds them at run time, so neither is mapped into every process (empty stubs on 2.34+).
    Library(
        "libvgpu.so",
        "",
        ("src",),
        "libvgpu.so",
        (),  # no libm: its two rounding calls are in src/compat.c
        cflags=("-include", str(SHIM_DIR / "src" / "glibc_compat.h")),
        # libc.so.6 named although only weak references may bind to some of its symbols (compat.c)
        needed=("libc.so.6",),
        # Lazy binding: the shim is loaded into every process of a container and imports ~70 C
        # library functions, most of which a process calls late or never; binding each at its
        # first call instead of all at load saves ~28,000 instructions per process start
        # (BENCHMARKS.md, "Shim start-up"). Every import is pinned to a version glibc 2.17 has
        # (glibc_compat.h, checked by tests/shim/test_glibc_bound.py), so none can be missing.
        bind_now=False,
        # nothing the compiler adds (-pthread's libpthread) lands in DT_NEEDED unless bound to
        as_needed=True,
    ),
    # The simulated NVIDIA driver: a stand-in for the real one, knows nothing of the shim.
    Library(
        "libcuda.so.1",
        "sim",
        ("sim/common", "sim/cuda"),
        "libcuda.so.1",
        ("pthread", "m", "rt", "dl"),
    ),
    Library(
        "libnvidia-ml.so.1",
        "sim",
        ("sim/common", "sim/nvml"),
        "libnvidia-ml.so.1",
        ("pthread", "m", "rt"),
    ),
)


@dataclass(frozen=True)
class Program:
    """One C executable shipped in the package (sharing/_lib), run by the Python tools."""

    filename: str
    source_dir: str  # relative to shim/
    libs: tuple[str, ...] = ()

    def sources(self) -> list[Path]:
        return sorted((SHIM_DIR / self.source_dir).glob("*.c"))

    def output_path(self, lib_root: Path) -> Path:
        return lib_root / self.filename


PROGRAMS: tuple[Program, ...] = (
    # `vgpu selftest`'s driver-API program (sharing/cli/selftest/): loads the driver with dlopen, so
    # it links against nothing of CUDA and runs on any node.
    Program("vgpu-selftest-probe", "selftest", ("dl",)),
)


def link_args(lib: Library) -> list[str]:
    needed = [f"-l:{n}" for n in lib.needed]
    if needed:  # whatever the toolchain's --as-needed default
        needed = ["-Wl,--push-state,--no-as-needed", *needed, "-Wl,--pop-state"]
    bind = "-Wl,-z,now" if lib.bind_now else "-Wl,-z,lazy"  # stated: toolchain defaults differ
    rest = ["-Wl,--as-needed"] if lib.as_needed else []
    return [f"-Wl,-soname,{lib.soname}", "-Wl,--no-undefined", bind, *needed, *rest]


def build_with_gcc(
    out_dir: Path,
    extra_cflags: Sequence[str] = (),
    cc: str = "gcc",
    only: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
) -> dict[str, Path]:
    """Build every library (or those whose filename is in `only`) with plain gcc into out_dir
    (tests use this for ASan/UBSan builds and driver variants). Each source is compiled on its
    own, as many at once as there are CPUs (a sanitized simulator is a minute of one core),
    then each library is linked.

    Returns {filename: path}.
    """
    libs = [lib for lib in LIBRARIES if not only or lib.filename in only]
    sanitized = "-fsanitize=address,undefined" in extra_cflags
    out: dict[str, Path] = {}
    with (
        tempfile.TemporaryDirectory(prefix="vgpu-objects-") as tmp,
        ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool,
    ):
        objects: dict[str, list[str]] = {}
        compiles = []
        for lib in libs:
            objects[lib.filename] = []
            for n, src in enumerate(lib.sources()):
                obj = str(Path(tmp) / f"{lib.filename}.{n}.o")
                objects[lib.filename].append(obj)
                cmd = [cc, *CFLAGS, *lib.cflags, *extra_cflags, f"-I{INCLUDE_DIR}", "-c", "-o",
                       obj, str(src)]  # fmt: skip
                compiles.append(pool.submit(subprocess.run, cmd, check=True))
        for job in compiles:
            job.result()  # CalledProcessError: gcc has said why on stderr
        links = []
        for lib in libs:
            target = lib.output_path(out_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            cmd = [
                cc,
                *CFLAGS,
                *extra_cflags,
                "-shared",
                "-o",
                str(target),
                *objects[lib.filename],
                *link_args(lib),
                *extra_ldflags,
                *[f"-l{x}" for x in lib.libs],
            ]
            if sanitized:
                # A sanitized library is preloaded into an unsanitized host: the runtime comes
                # from LD_PRELOAD of libasan, so undefined asan symbols are expected here.
                cmd.remove("-Wl,--no-undefined")
            links.append(pool.submit(subprocess.run, cmd, check=True))
            out[lib.filename] = target
        for job in links:
            job.result()
    return out

"""shim/src/compat.c, built as the shim builds it: libm's rounding replaced exactly, the moved
dl*/pthread_* calls reach the C library, and the loaded-object lookup (the fallback on a glibc
older than 2.34 whose process did not load libdl/libpthread at start) finds the same definition
as the dynamic linker."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shim.build import CFLAGS, INCLUDE_DIR, LIBRARIES
from tests.support.cbuild import C_PROGRAMS

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[2] / "shim" / "src"


def test_compat_layer(tmp_path: Path) -> None:
    shim = next(lib for lib in LIBRARIES if lib.filename == "libvgpu.so")
    if "-include" not in shim.cflags:
        pytest.skip("the shim is built without glibc_compat.h")
    exe = tmp_path / "compat_test"
    subprocess.run(
        ["gcc", *CFLAGS, *shim.cflags, f"-I{INCLUDE_DIR}", f"-I{SRC}", "-o", str(exe),
         str(C_PROGRAMS / "compat_test.c"), *(str(SRC / f) for f in ("compat.c", "elfsym.c", "log.c")),
         "-lm"],
        check=True,
    )  # fmt: skip
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    base = r.stdout.splitlines()[-1].split("@")[1].split(":")[0]  # the build's glibc base version
    assert r.stdout.splitlines() == [
        f"rounding: {17 + 600 * 16} values as libm",  # the listed cases and -300 .. 300 by 1/16
        "pthread_once: ran 1 time",  # twice called, once run
        "dlopen(libc.so.6, RTLD_NOLOAD): loaded",  # reached the C library's dlopen
        f"dlsym@{base}: as the dynamic linker",
    ], r.stdout

"""libvgpu.so loads into any glibc >= 2.17 image: the normal build binds to old symbol versions
(shim/src/glibc_compat.h), and the real dlsym is found portably or the shim fails closed."""

from __future__ import annotations

import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sharing.paths import shim_library
from tests.support.cbuild import C_PROGRAMS, CFLAGS
from tests.support.glibc_versions import GLIBC_BOUND, needed_glibc_versions, newer_than


def test_installed_shim_needs_no_glibc_newer_than_the_bound() -> None:
    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip(f"the bound is set for x86-64 and aarch64, not {platform.machine()}")
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    found = needed_glibc_versions(shim_library())
    assert found, "objdump found no glibc versions at all: the parser is broken"
    assert "GLIBC_2.2.5" in found or "GLIBC_2.17" in found
    assert newer_than(found, GLIBC_BOUND) == {}, (
        f"libvgpu.so needs glibc symbols newer than {GLIBC_BOUND}: {newer_than(found, GLIBC_BOUND)}"
        " (pin them in shim/src/glibc_compat.h or make the system call)"
    )


def test_shim_needs_libdl_and_libpthread_where_old_glibc_keeps_them() -> None:
    """Before glibc 2.34 dlopen and pthread_create are in libdl.so.2 and libpthread.so.0: without
    them in DT_NEEDED an old image's loader would not find the pinned versions."""
    out = subprocess.run(
        ["objdump", "-p", str(shim_library())], check=True, capture_output=True, text=True
    ).stdout
    needed = {line.split()[1] for line in out.splitlines() if line.strip().startswith("NEEDED")}
    assert {"libdl.so.2", "libpthread.so.0", "libc.so.6"} <= needed


def test_version_parser_sees_a_new_version(tmp_path: Path) -> None:
    """The bound test can fail: a library calling fstat directly needs GLIBC_2.33 here."""
    src = tmp_path / "new.c"
    src.write_text(
        "#include <sys/stat.h>\nint f(int fd) { struct stat st; return fstat(fd, &st); }\n"
    )
    lib = tmp_path / "libnew.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    release = platform.libc_ver()
    version = tuple(int(x) for x in release[1].split(".")[:2]) if release[1] else (0, 0)
    if release[0] != "glibc" or version < (2, 33):
        pytest.skip(f"the build machine's C library has no fstat@GLIBC_2.33: {release}")
    assert newer_than(needed_glibc_versions(lib), GLIBC_BOUND) == {"GLIBC_2.33": "fstat"}


def test_no_real_dlsym_fails_closed_with_one_line(
    tmp_path: Path, build_c: Callable[..., Path], shim_env: dict[str, str]
) -> None:
    """A C library whose dlvsym finds no dlsym (tests/c/no_dlvsym.c preloaded first): cuInit
    fails, the program's own dlsym answers NULL, one line says why; no crash."""
    fake = tmp_path / "libnodlvsym.so"
    subprocess.run(
        ["gcc", *CFLAGS, "-shared", "-fPIC", "-o", str(fake), str(C_PROGRAMS / "no_dlvsym.c")],
        check=True,
    )
    exe = build_c("sim_smoke.c")
    shim_env = dict(shim_env, SIMGPU_ALLOC_GRANULARITY="512")  # sim_smoke's exact byte counts
    env = dict(shim_env, LD_PRELOAD=f"{fake}:{shim_env['LD_PRELOAD']}")
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "64Mi"
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr  # CHECK(cuInit(0)) failed: exit(1), no signal
    assert "cuInit(0)" in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "cannot resolve the C library's dlsym" in ln]
    assert len(lines) == 1, r.stderr
    assert "GLIBC_2.34" in lines[0]
    # without the fake the same program runs
    r = subprocess.run([str(exe)], env=shim_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

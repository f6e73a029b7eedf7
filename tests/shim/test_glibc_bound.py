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

pytestmark = pytest.mark.slow


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


# The dl*/pthread_* functions libc.so.6 itself has exported since x86-64's and aarch64's first
# glibc (the rest lived in libdl.so.2 / libpthread.so.0 before 2.34).
IN_OLD_LIBC = {
    "dl_iterate_phdr",
    "pthread_attr_destroy",
    "pthread_attr_init",
    "pthread_attr_setdetachstate",
    "pthread_equal",
    "pthread_mutex_destroy",
    "pthread_mutex_init",
    "pthread_mutex_lock",
    "pthread_mutex_unlock",
    "pthread_self",
}


def test_shim_needs_neither_libdl_nor_libpthread() -> None:
    """Before glibc 2.34 dlopen and pthread_create are in libdl.so.2 and libpthread.so.0. The
    shim does not name them in DT_NEEDED (two more objects mapped into every process): each such
    call is a weak reference, bound where the C library has it and found at run time otherwise
    (shim/src/compat.c). A strong reference would stop an old image's process at its call."""
    lib = shim_library()
    out = subprocess.run(["objdump", "-p", str(lib)], check=True, capture_output=True, text=True)
    needed = {ln.split()[1] for ln in out.stdout.splitlines() if ln.strip().startswith("NEEDED")}
    assert "libc.so.6" in needed
    assert not needed & {"libdl.so.2", "libpthread.so.0"}, needed
    out = subprocess.run(["objdump", "-T", str(lib)], check=True, capture_output=True, text=True)
    undefined = [ln.split() for ln in out.stdout.splitlines() if "*UND*" in ln]
    weak = {f[-1] for f in undefined if f[1] == "w"}
    strong = {f[-1] for f in undefined if f[1] != "w"}
    moved = {n for n in strong if n.startswith(("dl", "pthread_")) and n not in IN_OLD_LIBC}
    assert moved == set(), f"strong references to libdl/libpthread functions: {sorted(moved)}"
    assert {"dlopen", "pthread_once", "pthread_create"} <= weak, sorted(weak)


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

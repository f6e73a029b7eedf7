"""The normal build of libvgpu.so in a process of an older glibc (2.17 .. 2.33), where dlopen
and pthread_create live in libdl.so.2 and libpthread.so.0, which the shim does not name in
DT_NEEDED (shim/src/compat.c): the quota holds for a program linked with the driver (the shim
loads libdl itself), with libdl preloaded ahead of the shim, and for a program that dlopens the
driver (libpthread only the driver's dependency).

Needs such a C library: an extracted Debian 11 `libc6` and `libc6-dev` (glibc 2.31), which
scripts/setup fetches (pinned by checksum) into .venv/old-glibc/root; VGPU_OLD_GLIBC_ROOT names
another. Without one the test skips saying so. x86-64 only."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

from sharing.paths import shim_library
from shim.build import build_with_gcc
from tests.support.cbuild import C_PROGRAMS, CFLAGS, INCLUDE

pytestmark = pytest.mark.slow

MiB = 1 << 20
ROOT_ENV = "VGPU_OLD_GLIBC_ROOT"
SETUP_ROOT = Path(__file__).resolve().parents[2] / ".venv" / "old-glibc" / "root"  # scripts/setup


@pytest.fixture(scope="module")
def old_root() -> Path:
    if platform.machine() != "x86_64":
        pytest.skip(f"the old-glibc check is set up for x86-64, not {platform.machine()}")
    root = os.environ.get(ROOT_ENV) or str(SETUP_ROOT)
    if not Path(root).is_dir():
        pytest.skip(f"{ROOT_ENV} is not set and scripts/setup could not fetch Debian 11's glibc "
                    f"into {SETUP_ROOT} (no network?)")  # fmt: skip
    path = Path(root)
    if not (path / "lib64" / "ld-linux-x86-64.so.2").exists():
        pytest.skip(f"{ROOT_ENV}={root} holds no lib64/ld-linux-x86-64.so.2")
    return path


def toolchain(root: Path) -> list[str]:
    """gcc flags that build against the old C library instead of the machine's (the kernel's
    headers, which libc6-dev does not ship, from the machine)."""
    lib = root / "usr" / "lib" / "x86_64-linux-gnu"
    return [
        f"--sysroot={root}", f"-B{lib}", f"-L{lib}", f"-L{root / 'lib' / 'x86_64-linux-gnu'}",
        "-idirafter", "/usr/include", "-idirafter", "/usr/include/x86_64-linux-gnu",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def old_build(old_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The simulated driver and the two test programs, built against the old glibc."""
    out = tmp_path_factory.mktemp("old-glibc")
    flags = toolchain(old_root)
    libs = build_with_gcc(out, extra_cflags=flags, only=["libcuda.so.1"])
    built = {"driver_dir": libs["libcuda.so.1"].parent}
    src = C_PROGRAMS / "old_glibc_quota.c"
    for name, extra in (
        ("linked", [f"-L{built['driver_dir']}", "-l:libcuda.so.1"]),
        ("dlopen", ["-DBY_DLOPEN", "-ldl"]),
    ):
        built[name] = out / name
        subprocess.run(
            ["gcc", *CFLAGS, *flags, f"-I{INCLUDE}", "-o", str(built[name]), str(src), *extra],
            check=True,
        )
    return built


def run_old(root: Path, build: dict[str, Path], prog: str, preload: str, n: int) -> str:
    libdir = root / "lib" / "x86_64-linux-gnu"
    state = build["driver_dir"].parent / "state"
    state.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SIMGPU_STATE": str(state),
        "CUDA_DEVICE_MEMORY_LIMIT": "64Mi",
        "LD_PRELOAD": preload,
    }
    r = subprocess.run(
        [str(root / "lib64" / "ld-linux-x86-64.so.2"), "--library-path",
         f"{build['driver_dir']}:{libdir}", str(build[prog]), str(n)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


@pytest.mark.parametrize(
    ("prog", "libdl_first"), [("linked", False), ("linked", True), ("dlopen", False)]
)
def test_quota_holds_on_an_old_glibc(
    prog: str, libdl_first: bool, old_root: Path, old_build: dict[str, Path]
) -> None:
    preload = str(shim_library())
    if libdl_first:
        preload = f"{old_root / 'lib' / 'x86_64-linux-gnu' / 'libdl.so.2'}:{preload}"
    assert "alloc=0" in run_old(old_root, old_build, prog, "", 128 * MiB)  # the driver alone
    out = run_old(old_root, old_build, prog, preload, 128 * MiB)
    assert "alloc=2" in out and "denied" in out, out  # CUDA_ERROR_OUT_OF_MEMORY
    assert "alloc=0" in run_old(old_root, old_build, prog, preload, 32 * MiB)

"""The shim and the simulator built for aarch64 (Debian's cross gcc) and run under qemu-user:
the same build description as the normal build (shim/build.py), the same glibc bound, and the
smoke test of a quota (allocate under it, be refused past it).

Skipped, saying which package is missing, where the cross toolchain or qemu-user is absent
(scripts/setup installs them on Debian)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from shim.build import build_with_gcc
from tests.support.cbuild import C_PROGRAMS, CFLAGS, INCLUDE
from tests.support.glibc_versions import GLIBC_BOUND, needed_glibc_versions, newer_than

CROSS_GCC = "aarch64-linux-gnu-gcc"
CROSS_OBJDUMP = "aarch64-linux-gnu-objdump"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # libc6-dev-arm64-cross


def _qemu() -> str | None:
    return shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


def _missing() -> str | None:
    if platform.machine() == "aarch64":
        return "the host is aarch64: the native tests cover it"
    if shutil.which(CROSS_GCC) is None or shutil.which(CROSS_OBJDUMP) is None:
        return f"{CROSS_GCC} is not installed (apt-get install gcc-aarch64-linux-gnu)"
    if not (SYSROOT / "lib" / "libc.so.6").exists() or not (SYSROOT / "include").is_dir():
        return f"no aarch64 C library in {SYSROOT} (apt-get install libc6-dev-arm64-cross)"
    if _qemu() is None:
        return "qemu-aarch64 is not installed (apt-get install qemu-user)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


@pytest.fixture(scope="module")
def aarch64_build(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """libvgpu.so and the simulated driver for aarch64, plus tests/c/e2e_claim_quota.c."""
    out = tmp_path_factory.mktemp("aarch64")
    libs = build_with_gcc(out, cc=CROSS_GCC)
    program = out / "claim_quota"
    subprocess.run(
        [
            CROSS_GCC, *CFLAGS, f"-I{INCLUDE}", "-o", str(program),
            str(C_PROGRAMS / "e2e_claim_quota.c"),
            f"-L{libs['libcuda.so.1'].parent}", "-l:libcuda.so.1",
        ],
        check=True,
    )  # fmt: skip
    return dict(libs, program=program)


def _run(
    build: dict[str, Path], state: Path, *args: str, preload_first: Path | None = None
) -> subprocess.CompletedProcess[str]:
    qemu = _qemu()
    assert qemu is not None
    preload = [str(p) for p in (preload_first, build["libvgpu.so"]) if p is not None]
    # -E sets the guest's environment: an LD_PRELOAD of the host would go to qemu itself
    guest_env = {
        "LD_LIBRARY_PATH": str(build["libcuda.so.1"].parent),
        "LD_PRELOAD": ":".join(preload),
        "SIMGPU_STATE": str(state),
        "CUDA_DEVICE_MEMORY_LIMIT": "64Mi",
        "SIMGPU_CONTEXT_MEMORY": "0",  # the smoke test's exact bytes, in a quota below a context
    }
    cmd = [qemu, "-L", str(SYSROOT)]
    for k, v in guest_env.items():
        cmd += ["-E", f"{k}={v}"]
    return subprocess.run(
        [*cmd, str(build["program"]), *args],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_aarch64_shim_needs_no_glibc_newer_than_the_bound(aarch64_build: dict[str, Path]) -> None:
    found = needed_glibc_versions(aarch64_build["libvgpu.so"], objdump=CROSS_OBJDUMP)
    assert "GLIBC_2.17" in found, found
    assert newer_than(found, GLIBC_BOUND) == {}


def test_aarch64_quota_smoke_under_qemu(aarch64_build: dict[str, Path], tmp_path: Path) -> None:
    """A CUDA program on the simulated GPU under the aarch64 shim: it sees the slice, allocates
    under the quota, is refused past it with one line."""
    state = tmp_path / "simgpu-state"
    state.mkdir(mode=0o700)
    r = _run(aarch64_build, state, "info")
    assert r.returncode == 0, r.stdout + r.stderr
    total, free, nvml = r.stdout.split()
    assert (total, free) == (f"total={64 << 20}", f"free={64 << 20}")
    assert nvml in ("nvml=0", "nvml=1"), r.stdout  # whether the shim read NVML: not judged here
    r = _run(aarch64_build, state, "alloc", str(32 << 20))
    assert (r.returncode, r.stdout.strip()) == (0, "alloc=0"), r.stderr
    r = _run(aarch64_build, state, "alloc", str(128 << 20))
    assert (r.returncode, r.stdout.strip()) == (0, "alloc=2"), r.stderr  # CUDA_ERROR_OUT_OF_MEMORY
    assert "device 0: 128.0 MiB denied" in r.stderr


def test_aarch64_no_real_dlsym_fails_closed(aarch64_build: dict[str, Path], tmp_path: Path) -> None:
    """aarch64's dlsym versions (GLIBC_2.34, GLIBC_2.17): with a dlvsym that finds neither
    (tests/c/no_dlvsym.c preloaded first) cuInit fails with one line, no crash."""
    fake = tmp_path / "libnodlvsym.so"
    subprocess.run(
        [CROSS_GCC, *CFLAGS, "-shared", "-fPIC", "-o", str(fake), str(C_PROGRAMS / "no_dlvsym.c")],
        check=True,
    )
    state = tmp_path / "simgpu-state"
    state.mkdir(mode=0o700)
    r = _run(aarch64_build, state, "info", preload_first=fake)
    assert r.returncode == 2, r.stdout + r.stderr  # the program's "cuInit failed" exit, no signal
    lines = [ln for ln in r.stderr.splitlines() if "cannot resolve the C library's dlsym" in ln]
    assert len(lines) == 1, r.stderr
    assert "GLIBC_2.34, GLIBC_2.17" in lines[0]

"""Where the built C artefacts live (the shim and the simulated driver)."""

from __future__ import annotations

from pathlib import Path

_LIB_ROOT = Path(__file__).resolve().parent / "_lib"


class ArtefactMissingError(RuntimeError):
    """A C artefact was never built (the package was not installed with its build step)."""


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise ArtefactMissingError(
            f"{path} is missing: build the package with `pip install -e .` from the source tree"
        )
    return path


def shim_library() -> Path:
    """Absolute path of libvgpu.so, the interposer."""
    return _existing(_LIB_ROOT / "libvgpu.so")


def sim_lib_dir() -> Path:
    """Directory holding the simulated libcuda.so.1 and libnvidia-ml.so.1 (for LD_LIBRARY_PATH)."""
    d = _LIB_ROOT / "sim"
    _existing(d / "libcuda.so.1")
    _existing(d / "libnvidia-ml.so.1")
    return d


def selftest_probe() -> Path:
    """The driver-API program `vgpu selftest` runs (shim/selftest/probe.c)."""
    return _existing(_LIB_ROOT / "vgpu-selftest-probe")

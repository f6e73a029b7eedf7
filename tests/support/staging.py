"""Copies of what a test runs as another user, in a directory that user can reach.

Tests that drop privileges (setpriv to nobody) must not load anything from the clone: a clone
inside a 0700 directory (a home directory, a CI workspace) is out of that user's reach, and the
loader then skips the shim or finds no driver. These helpers copy the shim, the simulated driver
and the cffi binding into a world-readable directory and point the environment at the copies.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from sharing.paths import shim_library, sim_lib_dir


def _world_readable_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o755)
    return path


def _copy(src: Path, dst_dir: Path) -> Path:
    dst = dst_dir / src.name
    shutil.copyfile(src, dst)
    dst.chmod(0o755)
    return dst


def stage_shim_env(base: Path, env: dict[str, str]) -> dict[str, str]:
    """`env` with the shim (LD_PRELOAD) and the simulated driver (LD_LIBRARY_PATH) replaced by
    copies under `base`, which must itself be reachable by the other user."""
    lib = _world_readable_dir(base / "staged-lib")
    sim = _world_readable_dir(lib / "sim")
    shim = _copy(shim_library(), lib)
    for f in sorted(sim_lib_dir().iterdir()):
        _copy(f, sim)
    out = dict(env)
    repl = {str(shim_library()): str(shim), str(sim_lib_dir()): str(sim)}
    for var, sep in (("LD_PRELOAD", ":"), ("LD_LIBRARY_PATH", ":")):
        if var in out:
            out[var] = sep.join(repl.get(x, x) for x in out[var].split(sep))
    return out


def stage_region_binding(base: Path) -> tuple[list[str], dict[str, str]]:
    """A Python command and environment that can `from sharing._region_cffi import ffi` as
    another user: the binding and cffi's backend copied under `base`, the base interpreter."""
    root = _world_readable_dir(base / "staged-py")
    pkg = _world_readable_dir(root / "sharing")
    for name in ("sharing._region_cffi", "_cffi_backend"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        _copy(Path(spec.origin), pkg if name.startswith("sharing.") else root)
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    env = {"PYTHONPATH": str(root), "PATH": os.environ.get("PATH", ""), "PYTHONNOUSERSITE": "1"}
    return [python, "-S"], env  # -S: nothing from site-packages, only the copies

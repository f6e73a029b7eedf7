"""The simulator plays the real driver under an LD_PRELOAD interposer (the sharing shim): its
legacy and convenience entry points never call its own exported functions through the dynamic
symbol table, so the interposer sees each application call exactly once, and cuGetProcAddress
returns the simulator's own functions."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.support.cbuild import C_PROGRAMS, CFLAGS, INCLUDE


def test_internal_calls_bypass_an_interposer(
    build_c: Callable[..., Path], sim_env: dict[str, str], tmp_path: Path
) -> None:
    lib = tmp_path / "libinterpose.so"
    subprocess.run(
        [
            "gcc",
            *CFLAGS,
            "-fPIC",
            "-shared",
            f"-I{INCLUDE}",
            "-o",
            str(lib),
            str(C_PROGRAMS / "sim_interpose_lib.c"),
            "-ldl",
        ],
        check=True,
    )
    exe = build_c("sim_interpose_main.c", ["-ldl"])
    env = dict(sim_env, LD_PRELOAD=str(lib))
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # the interposer counts the calls that reach its cuMemAlloc_v2 / cuMemFree_v2
    assert r.stdout.splitlines() == [
        "own _v2 calls: allocs=1 frees=1",
        # cuMemAlloc / cuMemFree / cuMemAllocAsync / cuMemFreeAsync do not route through them
        "after legacy and async calls: allocs=1 frees=1",
        "cuGetProcAddress(cuMemFree): simulator's=1 interposer's=0",
        "after the simulator's own functions: allocs=1 frees=1",
    ], r.stdout

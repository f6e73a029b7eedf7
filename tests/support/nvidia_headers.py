"""NVIDIA's own headers, from the pinned PyPI wheels of the test extras, to check ours against.

`nvidia-cuda-runtime-cu12` ships CUDA 12's cuda.h and cudaTypedefs.h (nvidia/cuda_runtime/include/),
`nvidia-cuda-runtime` CUDA 13's (nvidia/cu13/include/: our cuGetProcAddress table has CUDA 13 rows),
`nvidia-nvml-dev` ships nvml.h (nvidia/cu13/include/). They are test dependencies, so the
fidelity checks never skip: a missing wheel is a test failure naming the package to install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# (package in pyproject's test extras, path under the `nvidia` namespace package, header)
CUDA_WHEEL = ("nvidia-cuda-runtime-cu12", "cuda_runtime/include", "cuda.h")
CUDA13_WHEEL = ("nvidia-cuda-runtime", "cu13/include", "cuda.h")
NVML_WHEEL = ("nvidia-nvml-dev", "cu13/include", "nvml.h")


def _find(wheel: tuple[str, str, str]) -> Path:
    package, sub, header = wheel
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        d = Path(root) / sub
        if (d / header).is_file():
            return d
    raise FileNotFoundError(
        f"{header} not found under the `nvidia` package ({roots or 'not installed'}): "
        f"install the test extras (pip install -e '.[test]'), which pin {package}"
    )


def cuda_include() -> Path:
    """Directory holding CUDA 12's cuda.h and cudaTypedefs.h (the API level we declare)."""
    return _find(CUDA_WHEEL)


def cuda_includes() -> list[Path]:
    """CUDA 12's and CUDA 13's include directories."""
    return [_find(CUDA_WHEEL), _find(CUDA13_WHEEL)]


def nvml_include() -> Path:
    """Directory holding NVIDIA's nvml.h."""
    return _find(NVML_WHEEL)

"""The hook table (shim/src/hooks.def) as the tests read it."""

from __future__ import annotations

import re

from tests.support.shim_ops import REPO


def hooked_cuda_symbols() -> set[str]:
    """The CUDA driver entry points the shim hooks, by the name the driver exports."""
    text = (REPO / "shim" / "src" / "hooks.def").read_text()
    return set(re.findall(r"^VGPU_HOOK\(CUDA,\s*\w+,\s*(\w+),", text, re.M))

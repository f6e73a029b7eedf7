"""The glibc symbol versions a shared library needs, read with objdump (tests of the shim's bound)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

# The oldest glibc libvgpu.so must load on: CUDA 12's oldest supported distributions are older
# than glibc 2.34 (Ubuntu 20.04: 2.31, RHEL 8: 2.28); 2.17 is aarch64's first glibc ABI.
GLIBC_BOUND = "2.17"

_VERSION = re.compile(r"\bGLIBC_(?:PRIVATE|\d+(?:\.\d+)*)\b")


def _key(version: str) -> tuple[int, ...]:
    if version == "PRIVATE":  # glibc's internal ABI: changes with every release
        return (1 << 30,)
    return tuple(int(x) for x in version.split("."))


def needed_glibc_versions(library: Path, objdump: str = "objdump") -> dict[str, str]:
    """{"GLIBC_x.y": "what needs it"}: every version of an undefined dynamic symbol
    (objdump -T) and every version reference the loader checks at load (objdump -p)."""
    found: dict[str, str] = {}
    syms = subprocess.run(
        [objdump, "-T", str(library)], check=True, capture_output=True, text=True
    ).stdout
    for line in syms.splitlines():
        if "*UND*" not in line:
            continue
        m = _VERSION.search(line)
        if m:
            found.setdefault(m.group(0), line.split()[-1])
    headers = subprocess.run(
        [objdump, "-p", str(library)], check=True, capture_output=True, text=True
    ).stdout
    refs = headers.split("Version References:", 1)
    for m in _VERSION.finditer(refs[1] if len(refs) == 2 else ""):
        found.setdefault(m.group(0), "a version reference (objdump -p)")
    return found


def newer_than(found: dict[str, str], bound: str) -> dict[str, str]:
    """The entries of `found` newer than `bound` ("2.17")."""
    return {v: what for v, what in found.items() if _key(v.removeprefix("GLIBC_")) > _key(bound)}

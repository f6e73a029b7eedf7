"""shim/include/vgpu/cuda_procaddr.def is complete and agrees with NVIDIA's versioning.

Every function declared in vgpu/cuda_api.h has a row (and every one the simulator alone declares
in shim/sim/cuda/sim_api_ext.h and tensormap_api.h one in its procaddr_ext.def) (as symbol or per-thread symbol), every
symbol of the table is declared, rows of a name ascend, and each row's version is one NVIDIA's cudaTypedefs.h names: PFN_<name>_v<version>[_ptsz|_ptds] (in the cudaTypedefs.h of CUDA 12 or 13, from the pinned
nvidia-cuda-runtime-cu12 / nvidia-cuda-runtime wheels, test dependencies: never skipped).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.nvidia_headers import cuda_includes

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "shim" / "include" / "vgpu" / "cuda_api.h"
TABLE = REPO / "shim" / "include" / "vgpu" / "cuda_procaddr.def"
# the rows of the entry points only the simulator exports (shim/sim/cuda/sim_api_ext.h)
SIM_TABLE = REPO / "shim" / "sim" / "cuda" / "procaddr_ext.def"


def rows(table: Path = TABLE) -> list[tuple[str, int, str, str]]:
    out = []
    for m in re.finditer(r"^CU_PROC\((\w+), (\d+), (\w+), (\w*)\)$", table.read_text(), re.M):
        out.append((m.group(1), int(m.group(2)), m.group(3), m.group(4)))
    return out


def test_table_covers_the_header() -> None:
    declared = set(re.findall(r"VGPU_CUDA_API CUresult (\w+)\(", HEADER.read_text()))
    in_table = {r[2] for r in rows()} | {r[3] for r in rows() if r[3]}
    assert declared - in_table == set(), "declared but without a cuGetProcAddress row"
    assert in_table - declared == set(), "in the table but not declared"


def test_simulator_table_covers_its_headers() -> None:
    sim = REPO / "shim" / "sim" / "cuda"
    text = (sim / "sim_api_ext.h").read_text() + (sim / "tensormap_api.h").read_text()
    declared = set(re.findall(r"VGPU_CUDA_API CUresult (\w+)\(", text))
    table = rows(SIM_TABLE)
    in_table = {r[2] for r in table} | {r[3] for r in table if r[3]}
    assert declared - in_table == set(), "declared but without a cuGetProcAddress row"
    assert in_table - declared == set(), "in the table but not declared"


def test_rows_ascend_per_name() -> None:
    seen: dict[str, int] = {}
    for base, ver, _, _ in rows():
        assert ver > seen.get(base, 0), f"{base}: versions must ascend"
        seen[base] = ver


@pytest.mark.parametrize("table", [TABLE, SIM_TABLE], ids=["shared", "simulator"])
def test_versions_match_cuda_typedefs(table: Path) -> None:
    pfn: set[str] = set()
    for include in cuda_includes():
        text = (include / "cudaTypedefs.h").read_text()
        pfn |= set(re.findall(r"PFN_(\w+?_v\d+(?:_ptsz|_ptds)?)\b", text))
    missing = []
    previous: dict[str, str] = {}
    assert rows(table), table
    for base, ver, sym, pt in rows(table):
        if pt:
            suffix = pt[-5:]  # _ptsz / _ptds
            if f"{base}_v{ver}{suffix}" not in pfn:
                missing.append(f"{base}@{ver} ({pt})")
            # the row's plain symbol is either new at this version or carried over from the previous row
            if f"{base}_v{ver}" not in pfn and previous.get(base) != sym:
                missing.append(f"{base}@{ver} ({sym})")
        elif f"{base}_v{ver}" not in pfn and not (
            base == "cuGraphInstantiate" and sym == "cuGraphInstantiateWithFlags"
        ):
            missing.append(f"{base}@{ver} ({sym})")
        previous[base] = sym
    assert missing == []

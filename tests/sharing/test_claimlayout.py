"""The claim contract has one owner (sharing/claimlayout.py): the shim's compiled-in limits path,
the plugin's paths and the observers' look-ups all come from it."""

from __future__ import annotations

import re
from pathlib import Path

from driver.flags import parse
from sharing import claimlayout

REPO = Path(__file__).resolve().parents[2]


def test_the_shim_reads_the_limits_file_where_the_plugin_mounts_it() -> None:
    header = (REPO / "shim" / "src" / "settings.h").read_text()
    [path] = re.findall(r'#define VGPU_LIMITS_CONTAINER_PATH "([^"]+)"', header)
    assert path == claimlayout.CONTAINER_LIMITS


def test_the_preload_names_the_library_beside_the_limits_file() -> None:
    """The shim looks for `limits` beside itself first: the two must share a directory."""
    lib, limits = Path(claimlayout.CONTAINER_LIB), Path(claimlayout.CONTAINER_LIMITS)
    assert lib.parent == limits.parent and limits.name == claimlayout.LIMITS_FILE


def test_the_plugin_default_data_dir_is_the_layout_default() -> None:
    assert str(parse(["--node-name", "n"], env={}).data_dir) == claimlayout.DEFAULT_DATA_DIR


def test_no_other_module_spells_the_layout() -> None:
    """Names of the layout appear as string literals only in sharing/claimlayout.py."""
    literals = [
        f'"{claimlayout.CONTAINER_CLAIM_DIR}"',
        f'"{claimlayout.CONTAINER_LIB_DIR}',
        f'"{claimlayout.CONTAINER_NODE_STATE_DIR}"',
        f'"{claimlayout.CONTAINER_DEMAND_FILE}"',
        f'"{claimlayout.CHECKPOINT_FILE}"',
        f'"{claimlayout.MODE_FILE}"',
        f'"{claimlayout.DEFAULT_DATA_DIR}"',
        f'"{claimlayout.NODE_STATE_DIR}"',
        f'"{claimlayout.DEMAND_SUFFIX}"',
    ]
    found = []
    for d in ("driver", "sharing", "cdi"):
        for p in sorted((REPO / d).rglob("*.py")):
            if p.name == "claimlayout.py":
                continue
            text = p.read_text()
            found += [(str(p.relative_to(REPO)), lit) for lit in literals if lit in text]
    assert found == []

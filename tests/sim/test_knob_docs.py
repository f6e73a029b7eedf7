"""docs/simulator.md's knob table lists every knob the simulator reads, each with the
real-hardware fact it stands for (a fidelity knob without its fact is a guess)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def knobs_in_source() -> set[str]:
    found: set[str] = set()
    for src in (ROOT / "shim" / "sim").rglob("*.[ch]"):
        found |= set(re.findall(r'"(SIMGPU_[A-Z0-9_]+)"', src.read_text()))
    return found


def knob_table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "simulator.md").read_text()
    section = text.split("\n## Knobs\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        m = re.match(r"\| `([A-Z0-9_]+)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split(" | ")]
    return rows


def test_every_knob_is_documented_with_its_hardware_fact() -> None:
    source, table = knobs_in_source(), knob_table()
    assert len(source) >= 9  # the scan found the knobs
    missing = sorted(source - set(table))
    assert not missing, f"knobs read by shim/sim but not in docs/simulator.md's table: {missing}"
    stale = sorted(k for k in table if k.startswith("SIMGPU_") and k not in source)
    assert not stale, f"documented knobs the simulator no longer reads: {stale}"
    for name, cells in table.items():
        assert len(cells) == 3 and all(cells), f"{name}: needs meaning, default and hardware fact"

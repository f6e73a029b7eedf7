"""docs/architecture.md names every module as it now is: a file added, renamed or removed
without the map being updated fails here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _modules() -> set[str]:
    files = [
        *REPO.glob("driver/*.py"),
        *REPO.glob("sharing/*.py"),
        *REPO.glob("cdi/*.py"),
        *REPO.glob("shim/src/*.c"),
        *REPO.glob("shim/src/*.def"),
        *REPO.glob("shim/sim/*/*.c"),
        *REPO.glob("shim/sim/*/*.def"),
    ]
    return {p.name for p in files if p.name != "__init__.py"}


def test_every_module_is_on_the_map() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(?:[a-z]+/)?([\w.]+\.(?:py|c|def))`", doc))
    assert sorted(_modules() - named) == []
    assert sorted(named - _modules()) == []  # no module that is gone

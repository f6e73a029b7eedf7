"""docs/architecture.md names every module as it now is, and the import graph keeps the rooms'
rule: a file added, renamed or removed without the map being updated, an import that runs back
up (the contract importing an observer, anything but the commands importing `sharing.cli`,
anything importing `driver`) or a circle of imports fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.graphs import circles

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("driver", "sharing", "cdi")


def _modules() -> set[str]:
    files = [
        *REPO.glob("driver/*.py"),
        *REPO.glob("sharing/*.py"),
        *REPO.glob("sharing/observe/*.py"),
        *REPO.glob("sharing/cli/*.py"),
        *REPO.glob("cdi/*.py"),
        *REPO.glob("shim/src/*.c"),
        *REPO.glob("shim/src/*.def"),
        *REPO.glob("shim/sim/*/*.c"),
        *REPO.glob("shim/sim/*/*.def"),
    ]
    return {p.name for p in files if p.name not in ("__init__.py", "__main__.py")}


def test_every_module_is_on_the_map() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(?:[a-z]+/)?([\w.]+\.(?:py|c|def))`", doc))
    assert sorted(_modules() - named) == []
    assert sorted(named - _modules()) == []  # no module that is gone


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports when it runs (imports under
    `if TYPE_CHECKING:` never run and are left out; generated stubs are included)."""
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "_lib" not in p.parts]
    names = {_module_name(p): p for p in files}
    out: dict[str, set[str]] = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        type_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in names:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        out[name] = deps
    return out


def _room(module: str) -> str:
    """driver, cdi, cli (the commands), observe (what reads the node) or contract."""
    parts = module.split(".")
    if parts[0] != "sharing":
        return parts[0]
    if len(parts) > 1 and parts[1] in ("cli", "observe"):
        return parts[1]
    return "contract"


# which rooms each room may import (itself always)
ALLOWED = {
    "contract": {"contract"},
    "observe": {"contract", "observe"},
    "cli": {"contract", "observe", "cli"},
    "cdi": {"cdi", "contract"},
    "driver": {"driver", "cdi", "contract", "observe"},
}


def test_imports_run_one_way() -> None:
    bad = [
        f"{m} ({_room(m)}) imports {d} ({_room(d)})"
        for m, deps in sorted(_graph().items())
        for d in sorted(deps)
        if _room(d) not in ALLOWED[_room(m)]
    ]
    assert bad == []


def test_no_import_circle() -> None:
    assert circles(_graph()) == []


def test_the_checks_see_a_circle_and_an_import_back_up() -> None:
    """The graph is read from the real files: a known edge is in it (so the two checks above
    look at something)."""
    graph = _graph()
    assert "sharing.observe.procinfo" in graph["sharing.observe.watchdog"]
    assert "sharing.cli.exporter" in graph["sharing.cli.main"]
    assert "sharing.observe.exporter" in graph["driver.main"]

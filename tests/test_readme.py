"""What the README names exists: every link, every path of the repository, every command and
every flag it shows. A newcomer follows the README first; a renamed file or flag must fail here,
not on their machine."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from driver.flags import _FLAGS
from sharing.cli.main import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TEXT = README.read_text()

LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)
# The repository's top-level folders and files: a path in the README that starts with one of them
# names something of the tree (DATA/..., /tmp/..., .../vgpu-sharing/limits are not the tree's).
TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
PATH = re.compile(
    r"(?<![\w./-])((?:" + "|".join(map(re.escape, sorted(TOP))) + r")(?:/[\w.*-]+)*/?)"
)


def _links() -> list[str]:
    return [t.split("#", 1)[0] for t in LINK.findall(TEXT) if not re.match(r"[a-z]+://", t)]


def _paths() -> list[str]:
    """Paths in code (`...`, fenced blocks), and in prose those that end in a file's suffix."""
    found: set[str] = set()
    prose = re.findall(r"[\w./-]+\.(?:md|py|sh|yaml|json|c|h)\b", FENCE.sub("", CODE.sub("", TEXT)))
    for snippet in [*CODE.findall(TEXT), *FENCE.findall(TEXT), *prose]:
        for m in PATH.finditer(snippet):
            p = m.group(1).rstrip("/.")
            if "/" in p or (REPO / p).is_file():
                found.add(p)
    return sorted(found)


def _commands() -> list[list[str]]:
    """Each `vgpu ...` and `vgpu-kubelet-plugin ...` command line the README shows, as words."""
    lines: list[str] = []
    for block in FENCE.findall(TEXT):
        logical = re.sub(r"\\\n\s*", " ", block)
        lines += [ln.split("#", 1)[0] for ln in logical.splitlines()]
    lines += CODE.findall(TEXT)
    out = []
    for ln in lines:
        m = re.search(r"(?:^|[\s/])(vgpu(?:-kubelet-plugin)?)\s+(.*)", ln)
        if m and not m.group(2).startswith("COMMAND"):
            words = shlex.split(m.group(2).split(" -- ", 1)[0])
            out.append([m.group(1), *(w for w in words if w != "...")])
    return out


def test_the_readme_names_things_at_all() -> None:
    """The parses find what the README is known to hold (an empty parse would pass vacuously)."""
    assert "docs/architecture.md" in _links()
    assert {"scripts/demo", "shim/src", "deploy/overlays/sharing"} <= set(_paths())
    assert ["vgpu", "info", "--sim"] in _commands()
    assert ["vgpu-kubelet-plugin", "--metrics-address", ":9402"] in _commands()


@pytest.mark.parametrize("link", sorted(set(_links())))
def test_every_link_exists(link: str) -> None:
    assert (REPO / link).exists(), f"README.md links to {link}, which is not in the tree"


@pytest.mark.parametrize("path", _paths())
def test_every_path_exists(path: str) -> None:
    if "*" in path:
        assert list(REPO.glob(path)), f"README.md names {path}: nothing matches"
        return
    assert (REPO / path).exists(), f"README.md names {path}, which is not in the tree"
    if path.startswith("scripts/") or path.endswith(".sh"):
        assert (REPO / path).stat().st_mode & 0o111, f"{path}: the README runs it; not executable"


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_every_vgpu_command_and_flag_exists() -> None:
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    commands: dict[str, argparse.ArgumentParser] = dict(sub.choices)
    plugin = {f"--{f.name}" for f in _FLAGS} | {"--help"}
    wrong = []
    for words in _commands():
        if words[0] == "vgpu":
            name, rest = words[1], words[2:]
            if name not in commands:
                wrong.append(f"vgpu {name}: no such command")
                continue
            known = _options(commands[name])
        else:
            rest, known = words[1:], plugin
        for w in rest:
            flag = w.split("=", 1)[0]
            if flag.startswith("--") and flag not in known:
                wrong.append(f"{' '.join(words[:2])}: no flag {flag}")
    assert not wrong, wrong


def test_the_readme_lists_every_vgpu_command() -> None:
    """ "Those are all the `vgpu` commands": the list is the parser's."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    m = re.search(r"Those are all the `vgpu` commands: (.*?)\n\(", TEXT, re.S)
    assert m, "the README's list of vgpu commands is gone"
    assert set(CODE.findall(m.group(1))) == set(sub.choices)

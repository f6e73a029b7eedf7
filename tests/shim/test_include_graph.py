"""The C code's files depend on each other one way.

A module is a .c file with its header of the same name (x.c + x.h). Its dependencies are the
`#include "..."` lines of both: in shim/src and in the simulator (shim/sim) each file declares what
it offers in its own header, so the include lines are the dependency graph. This test keeps that
graph free of circles, keeps it inside the layers of docs/architecture.md (a module includes only
modules of its own layer or below), and checks that the include lines tell the truth: every
function or variable a compiled file uses from another file is reachable through its includes.
The simulator's files also call each other's driver entry points (cuMemFree_v2, the
cuGetProcAddress table), declared by the API header rather than by the file's own: those calls
need no include, but they count as dependencies too, and run down the layers without circles.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

from shim.build import CFLAGS, INCLUDE_DIR, LIBRARIES, SHIM_DIR, Library
from tests.support.graphs import Graph, circles

REPO = Path(__file__).resolve().parents[2]
SRC = SHIM_DIR / "src"
SIM = SHIM_DIR / "sim"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)

SIM_DIRS = [SIM / "common", SIM / "cuda", SIM / "nvml"]


def _module(path: Path, root: Path) -> str:
    """x.c and x.h are one module, named by its path under root without the suffix."""
    rel = path.relative_to(root)
    return str(rel.with_suffix("")) if rel.suffix in (".c", ".h") else str(rel)


def include_graph(root: Path, dirs: Iterable[Path]) -> Graph:
    """Module -> the modules its files include (headers found beside the file or under shim/include)."""
    graph: Graph = {}
    for d in dirs:
        for f in sorted([*d.glob("*.c"), *d.glob("*.h"), *d.glob("*.def")]):
            mod = _module(f, root)
            deps = graph.setdefault(mod, set())
            for name in INCLUDE.findall(f.read_text()):
                target = (f.parent / name).resolve()
                if not target.exists():
                    target = INCLUDE_DIR / name
                assert target.exists(), (
                    f'{f}: #include "{name}" found neither beside it nor in shim/include'
                )
                if target.is_relative_to(root):
                    dep = _module(target, root)
                    if dep != mod:
                        deps.add(dep)
                        graph.setdefault(dep, set())
    return graph


def reachable(graph: Graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_the_finder_sees_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_shim_includes_run_one_way() -> None:
    assert circles(include_graph(SRC, [SRC])) == []


def test_the_simulator_includes_run_one_way() -> None:
    assert circles(include_graph(SIM, SIM_DIRS)) == []


def doc_layers(title: str = "### Layers of the shim") -> dict[str, int]:
    """A layer table of docs/architecture.md (shim/src's by default): module -> layer number
    (1 = bottom). Modules are named by their path under the table's root (`cuda/memory.c`)."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc.split(title, 1)[1].split("\n#", 1)[0]
    layers: dict[str, int] = {}
    for number, files in re.findall(r"^\| (\d+) [^|]*\| ([^|]+) \|", section, re.M):
        for name in re.findall(r"`([\w./]+)`", files):
            mod = name.rsplit(".", 1)[0] if name.endswith((".c", ".h")) else name
            assert mod not in layers, f"{name} is in two layers of docs/architecture.md"
            layers[mod] = int(number)
    return layers


def upward(graph: Graph, layers: dict[str, int], verb: str = "includes") -> list[str]:
    return [
        f"{m} (layer {layers[m]}) {verb} {d} (layer {layers[d]})"
        for m in sorted(graph)
        for d in sorted(graph[m])
        if layers[d] > layers[m]
    ]


def check_layers(graph: Graph, layers: dict[str, int]) -> None:
    """Every module is in one layer of the doc, and includes nothing above it."""
    assert sorted(set(graph) - set(layers)) == [], "modules missing from the layer table"
    assert sorted(set(layers) - set(graph)) == [], "layer table names modules that do not exist"
    assert upward(graph, layers) == []


def test_the_layers_of_the_doc_hold() -> None:
    check_layers(include_graph(SRC, [SRC]), doc_layers())


def test_the_simulators_layers_of_the_doc_hold() -> None:
    check_layers(include_graph(SIM, SIM_DIRS), doc_layers("### Layers of the simulator"))


def _symbols(obj: Path) -> tuple[set[str], set[str]]:
    """(defined, undefined) global symbols of an object file."""
    out = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TDBRCGS":
            defined.add(parts[2])
        elif len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
    return defined, undefined


def _library(filename: str) -> Library:
    return next(lib for lib in LIBRARIES if lib.filename == filename)


def file_uses(lib: Library, root: Path, out: Path) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Compile each source of lib: (symbol -> the module defining it, module -> symbols it uses)."""
    if shutil.which("gcc") is None or shutil.which("nm") is None:
        pytest.skip("needs gcc and nm (binutils) to compile the C files and read their objects")
    defined_by: dict[str, str] = {}
    uses: dict[str, set[str]] = {}
    for src in lib.sources():
        mod = _module(src, root)
        obj = out / f"{mod.replace('/', '_')}.o"
        # -O0: the graph does not depend on optimisation, and it compiles fastest
        cmd = [
            "gcc",
            *CFLAGS,
            *lib.cflags,
            "-O0",
            "-g0",
            f"-I{INCLUDE_DIR}",
            "-c",
            str(src),
            "-o",
            str(obj),
        ]
        subprocess.run(cmd, check=True)
        defined, undefined = _symbols(obj)
        for s in defined:
            defined_by[s] = mod
        uses[mod] = undefined
    return defined_by, uses


def use_graph(defined_by: dict[str, str], uses: dict[str, set[str]]) -> Graph:
    """Module -> the modules whose functions or variables it uses."""
    return {
        mod: {defined_by[s] for s in syms if s in defined_by and defined_by[s] != mod}
        for mod, syms in uses.items()
    }


@pytest.mark.slow
def test_the_includes_name_every_file_a_shim_file_uses(tmp_path: Path) -> None:
    """A file that uses another's function without including its header (an extern of its own, a
    header that declares another file's functions) would hide a dependency from the graph."""
    defined_by, uses = file_uses(_library("libvgpu.so"), SRC, tmp_path)
    graph = include_graph(SRC, [SRC])
    # the build includes glibc_compat.h into every file: the C library calls it renames (to
    # compat.c's) are every file's, compat.c being at the bottom
    forced = set(re.findall(r"\bvgpu_compat_\w+", (SRC / "glibc_compat.h").read_text()))

    def declared(mod: str, sym: str) -> bool:
        seen = reachable(graph, mod)
        # hook_<symbol> is declared by hooks.h (from hooks.def) for whichever file defines it
        return (
            defined_by[sym] in seen
            or sym in forced
            or (sym.startswith("hook_") and "hooks" in seen)
        )

    hidden = sorted(
        f"{mod} uses {sym} of {defined_by[sym]}.c without including {defined_by[sym]}.h"
        for mod, syms in uses.items()
        for sym in syms
        if sym in defined_by and defined_by[sym] != mod and not declared(mod, sym)
    )
    assert hidden == []


# A driver entry point (cuMemAlloc_v2, nvmlDeviceGetCount, ...): declared by the API header the
# shim shares (shim/include/vgpu), not by the header of the simulator file that defines it.
ENTRY_POINT = re.compile(r"(cu|nvml)[A-Z]\w*")


@pytest.mark.slow
@pytest.mark.parametrize("filename", ["libcuda.so.1", "libnvidia-ml.so.1"])
def test_the_simulators_files_use_each_other_one_way(filename: str, tmp_path: Path) -> None:
    """What a simulator file uses of another runs down the layers without circles (its calls of
    another file's entry points included), and comes through an include (entry points aside)."""
    defined_by, uses = file_uses(_library(filename), SIM, tmp_path)
    used = use_graph(defined_by, uses)
    assert circles(used) == []
    assert upward(used, doc_layers("### Layers of the simulator"), "uses") == []
    graph = include_graph(SIM, SIM_DIRS)
    hidden = sorted(
        f"{mod} uses {sym} of {defined_by[sym]}.c without including {defined_by[sym]}.h"
        for mod, syms in uses.items()
        for sym in syms
        if sym in defined_by
        and defined_by[sym] != mod
        and not ENTRY_POINT.fullmatch(sym)
        and defined_by[sym] not in reachable(graph, mod)
    )
    assert hidden == []

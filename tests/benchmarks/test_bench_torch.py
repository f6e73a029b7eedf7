"""benchmarks/bench_torch.py's machinery (its figures are measured, never asserted here): every part
it measures has its block in BENCHMARKS.md and `--update-md` rewrites that block alone; a bad
--gemm-n is refused; the callgrind toggle (benchmarks/callgrind.py, shared with bench_vllm.py) counts the instructions between cg_start and cg_stop and
nothing of the interpreter's start-up."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks import callgrind

REPO = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_torch", REPO / "benchmarks" / "bench_torch.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()


def test_every_part_has_one_block_in_benchmarks_md() -> None:
    text = (REPO / "BENCHMARKS.md").read_text()
    for part in bench.PARTS:
        begin, end = bench.markers(part)
        assert text.count(begin) == 1 and text.count(end) == 1, part
        assert text.index(begin) < text.index(end), part


def test_update_md_rewrites_only_the_measured_part(tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    before = (REPO / "BENCHMARKS.md").read_text()
    md.write_text(before)
    bench.update_md({"matmul": ["new matmul table"]}, md)
    after = md.read_text()
    begin, end = bench.markers("matmul")
    assert f"{begin}\nnew matmul table\n{end}" in after
    head, tail = before.split(begin)[0], before.split(end)[1]
    assert after.startswith(head) and after.endswith(tail)


def test_update_md_without_the_markers_says_so(tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n")
    with pytest.raises(SystemExit, match="has no <!-- bench_torch:overhead:begin -->"):
        bench.update_md({"overhead": ["x"]}, md)


@pytest.mark.parametrize("spec", ["188", "188:", "a:1", "188:9216:1"])
def test_a_bad_gemm_size_is_refused(spec: str) -> None:
    with pytest.raises(SystemExit, match="expected SM:N"):
        bench.parse_gemm_n(spec)


def test_gemm_sizes_override_the_measured_ones() -> None:
    table = bench.parse_gemm_n("16:3072,200:9216")
    assert table[16] == 3072 and table[200] == 9216 and table[132] == bench.GEMM_N[132]


LOOP = """
import ctypes, sys
toggle = ctypes.CDLL(sys.argv[1])
n = int(sys.argv[2])
toggle.cg_start()
x = 0
for i in range(n):
    x += i
toggle.cg_stop()
"""


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("valgrind"), reason="valgrind is not installed")
def test_callgrind_counts_only_between_the_toggles(tmp_path: Path) -> None:
    lib = callgrind.build_toggle(tmp_path)

    def count(n: int) -> int:
        out = tmp_path / f"cg.{n}"
        subprocess.run(
            [*callgrind.wrapper(out), sys.executable, "-c", LOOP, str(lib), str(n)],
            check=True,
            capture_output=True,
            timeout=600,
        )
        return sum(callgrind.thread_totals(out))

    empty, loop = count(0), count(20_000)
    # Python's start-up alone is tens of millions of instructions; an empty toggle pair a few
    # thousand at most; each iteration of the loop tens
    assert empty < 50_000, empty
    assert loop - empty > 20_000 * 10, (empty, loop)

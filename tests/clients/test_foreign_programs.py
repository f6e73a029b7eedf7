"""Programs nobody here wrote, from PyPI (pinned in scripts/setup, installed into .venv/frameworks),
run unmodified under `vgpu run --sim --memory 2Gi` (tests/support/foreign_programs.py): the
framework shows the program the slice, the driver read from outside never holds more than the
quota for it, and the same program asked for more than the quota meets its framework's own
out-of-memory error.

torch-bench-gpu 0.1.3 (`python -m torch_bench_gpu --size N --iters I`): a GEMM-throughput CLI on
PyTorch; for each regime (FP32, TF32, FP16, BF16, FP8 through torch._scaled_mm; INT8 needs
torchao, not installed) it allocates two N x N matrices, multiplies them 50 + I times and prints
a table; a regime that raises RuntimeError (torch.cuda.OutOfMemoryError is one) is a table row
with the error's first line. Kernels compute nothing on the simulator; the program checks no
values."""

from __future__ import annotations

import re

import pytest

from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.clients import Client, frameworks_python
from tests.support.foreign_programs import ForeignRun, run_foreign

pytestmark = pytest.mark.slow

MiB = 1 << 20
QUOTA = 2 << 30
REGIMES = ("FP32-CUDA", "TF32", "FP16", "BF16", "FP8-E4M3")


@pytest.fixture
def bench_python() -> str:
    return frameworks_python("torch_bench_gpu")


def _rows(out: str) -> dict[str, tuple[str, str]]:
    """torch_bench_gpu's table: regime -> (performance column, notes column)."""
    rows = {}
    for m in re.finditer(r"^\|\s*(\S+)\s*\|[^|]*\|[^|]*\|\s*([^|]*?)\s*\|(.*)\|$", out, re.M):
        rows[m.group(1)] = (m.group(2), m.group(3).strip())
    return rows


def _held_within_quota(run: ForeignRun) -> int:
    """The one process's memory as the driver shows it from outside; never above the quota."""
    assert len(run.held) == 1, run.held
    (used,) = run.held.values()
    assert used <= QUOTA, run.held
    assert run.sampled["over"] == 0 and run.sampled["peak"] <= QUOTA, run.sampled
    assert run.sampled["peak"] >= CONTEXT_MEMORY, run.sampled  # it sampled the program
    return used


def _bench(
    client: Client, python: str, size: int, iters: int
) -> tuple[ForeignRun, dict[str, tuple[str, str]]]:
    """Run torch_bench_gpu in the slice; it exits 0 whatever each regime met."""
    run = run_foreign(
        client.env, python, "torch", "torch_bench_gpu", "--size", str(size), "--iters", str(iters),
        quota=QUOTA,
    )  # fmt: skip
    assert run.rc == 0, run.out + run.err[-4000:]
    # what the program saw: the slice, less the context the CUDA runtime created
    assert (run.free, run.total) == (QUOTA - CONTEXT_MEMORY, QUOTA), run.out
    return run, _rows(run.out)


def test_torch_bench_gpu_runs_in_the_slice(client: Client, bench_python: str) -> None:
    run, rows = _bench(client, bench_python, 4096, 5)
    for regime in REGIMES:
        perf, note = rows[regime]
        assert re.fullmatch(r"[\d,]+\.\d\d", perf), (regime, perf, note)
    assert rows["INT8"][1] == "torchao missing", rows
    used = _held_within_quota(run)
    # the allocator still reserves at least one regime's two 64 MiB matrices and its product
    assert used >= CONTEXT_MEMORY + 3 * 64 * MiB, run.held


def test_torch_bench_gpu_over_the_quota_meets_torchs_oom(client: Client, bench_python: str) -> None:
    """--size 20000: one float32 matrix is 1.49 GiB, two do not fit in the 2 GiB slice."""
    run, rows = _bench(client, bench_python, 20000, 1)
    for regime in REGIMES:
        perf, note = rows[regime]
        assert perf == "n/a", (regime, perf, note)
        # torch.cuda.OutOfMemoryError's own message, with the slice as the device's capacity
        assert note.startswith("CUDA out of memory. Tried to allocate"), (regime, note)
        assert "GPU 0 has a total capacity of 2.00 GiB" in note, (regime, note)
    used = _held_within_quota(run)
    # the first float32 matrix fitted and is still reserved: the slice is nearly full
    assert used >= CONTEXT_MEMORY + 20000 * 20000 * 4, run.held

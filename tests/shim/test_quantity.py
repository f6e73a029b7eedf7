"""The C and the Python quantity parsers accept exactly the same forms (one table for both)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from sharing.cli import run
from sharing.quantity import QuantityError, parse_bytes
from tests.support.quantity_cases import C_ONLY_REJECTED
from tests.support.quantity_cases import HAMI as CASES


def _python(text: str) -> int | None:
    try:
        return parse_bytes(text)
    except QuantityError:
        return None


def _c(harness: Path, texts: list[str]) -> list[int | None]:
    out = subprocess.run(
        [str(harness), "parse", *texts], capture_output=True, text=True, check=True
    )
    lines = out.stdout.splitlines()
    assert len(lines) == len(texts)
    return [int(line.split()[1]) if line.startswith("OK ") else None for line in lines]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_python_parser(text: str, expected: int | None) -> None:
    assert _python(text) == expected


def test_c_parser_agrees_with_the_table(shim_harness: Path) -> None:
    texts = [t for t, _ in CASES]
    got = _c(shim_harness, texts)
    mismatches = [(t, e, g) for (t, e), g in zip(CASES, got, strict=True) if e != g]
    assert mismatches == []


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_vgpu_run_memory_agrees_with_the_table(text: str, expected: int | None) -> None:
    """`vgpu run --memory` takes what the shim takes and passes it on as bytes; 0 is the
    shim's "no limit" and reaches it as 0; a quota below any allocation (a missing unit) is
    refused."""
    if expected is not None and 0 < expected < run.MIN_QUOTA:
        expected = None
    ap = argparse.ArgumentParser()
    run.register(ap.add_subparsers())
    args = ap.parse_args(["run", f"--memory={text}", "--", "true"])
    try:
        env = run.build_env(args, {})
    except run.RunConfigError:
        assert expected is None
        return
    assert env["CUDA_DEVICE_MEMORY_LIMIT"] == str(expected)


def test_c_parser_refuses_beyond_64_bits(shim_harness: Path) -> None:
    assert _c(shim_harness, C_ONLY_REJECTED) == [None] * len(C_ONLY_REJECTED)

"""Every reader of a compute cap accepts the same values with the same meaning: the shim's
environment, the limits file and `vgpu run --compute` (one table: percent_cases.py)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from sharing.cli import run
from sharing.limitsfile import LimitsFileError, parse_limits_file
from sharing.percent import FORMS, PercentError, parse_permille
from tests.support.percent_cases import CASES


def _python(text: str) -> int | None:
    try:
        return parse_permille(text)
    except PercentError:
        return None


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_python_parser(text: str, expected: int | None) -> None:
    assert _python(text) == expected


@pytest.mark.slow
def test_shim_environment_agrees_with_the_table(shim_harness: Path) -> None:
    got: list[tuple[str, int | None]] = []
    for text, _ in CASES:
        env = {"CUDA_DEVICE_SM_LIMIT": text, "PATH": "/usr/bin:/bin"}
        r = subprocess.run(
            [str(shim_harness), "cap"], env=env, capture_output=True, text=True, check=True
        )
        out = r.stdout.split()
        got.append((text, int(out[1]) if out[0] == "OK" else None))
        if out[0] == "ERR":  # one line naming the variable and the same forms as Python's
            assert f"accepted: {FORMS}" in r.stderr, r.stderr
    assert got == CASES


def _limits_file(value: str) -> str:
    return (
        f"CUDA_DEVICE_MEMORY_LIMIT_0=1024\nCUDA_DEVICE_SM_LIMIT_0={value}\n"
        "VGPU_COMPUTE_POLICY=hard\nVGPU_PRIORITY=1\nCUDA_DEVICE_MEMORY_SHARED_CACHE=/r\n"
    )


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_limits_file_agrees_with_the_table(text: str, expected: int | None) -> None:
    try:
        parse_limits_file(_limits_file(text))
        accepted = True
    except LimitsFileError as e:
        assert "CUDA_DEVICE_SM_LIMIT_0" in str(e) and "\n" not in str(e)
        accepted = False
    assert accepted == (expected is not None)


def _run_args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    run.register(ap.add_subparsers())
    return ap.parse_args(["run", *argv, "--", "true"])


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_vgpu_run_compute_agrees_with_the_table(text: str, expected: int | None) -> None:
    for flag, var in (
        ("--compute", "CUDA_DEVICE_SM_LIMIT"),
        ("--compute-3", "CUDA_DEVICE_SM_LIMIT_3"),
    ):
        try:
            env = run.build_env(_run_args(f"{flag}={text}"), {})
        except run.RunConfigError as e:
            assert expected is None, e
            assert str(e).startswith(f"{flag}: ") and FORMS in str(e)
            continue
        assert expected is not None, (flag, text)
        assert parse_permille(env[var]) == expected

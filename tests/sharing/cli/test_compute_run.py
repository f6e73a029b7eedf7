"""`vgpu run --compute/--compute-<i>/--policy/--priority` (sharing/cli/compute_run.py)."""

from __future__ import annotations

import argparse

import pytest

from sharing.cli import run


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    run.register(sub)
    return ap.parse_args(["run", *argv, "--", "true"])


def test_flags_become_the_shims_environment() -> None:
    a = parse("--compute", "30", "--compute-1", "70", "--policy", "elastic", "--priority", "0")
    env = run.build_env(a, {})
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert env["CUDA_DEVICE_SM_LIMIT_1"] == "70"
    assert env["VGPU_COMPUTE_POLICY"] == "elastic"
    assert env["VGPU_PRIORITY"] == "0"


def test_no_flags_no_variables() -> None:
    env = run.build_env(parse(), {})
    assert not [
        k for k in env if k.startswith(("CUDA_DEVICE_SM_LIMIT", "VGPU_COMPUTE", "VGPU_PRIORITY"))
    ]


@pytest.mark.parametrize(
    "argv", [("--compute", "abc"), ("--compute", "-3"), ("--compute-2", "nan"), ("--priority", "x")]
)
def test_bad_values_are_refused(argv: tuple[str, str]) -> None:
    with pytest.raises(run.RunConfigError) as e:
        run.build_env(parse(*argv), {})
    assert argv[0] in str(e.value) and "\n" not in str(e.value)


def test_bad_policy_is_refused_by_argparse() -> None:
    with pytest.raises(SystemExit):
        parse("--policy", "soft")

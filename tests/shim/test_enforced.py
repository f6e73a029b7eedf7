"""`vgpu run` resolves the limits with the shim's own code (shim/src/enforced.c through the cffi
binding, sharing/enforced.py): what `--show` prints, what FILE.limits records and what `vgpu run`
refuses are what the shim enforces or refuses in the command's processes. Checked against the
shim's setup code (the harness, built from shim/src) and against the preloaded shim's own line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sharing._region_cffi import lib

from sharing import enforced
from tests.support.shim_ops import parse_ops

GiB = 1 << 30
POLICY = {"hard": lib.VGPU_COMPUTE_POLICY_HARD, "elastic": lib.VGPU_COMPUTE_POLICY_ELASTIC,
          "off": lib.VGPU_COMPUTE_POLICY_OFF}  # fmt: skip

ENVIRONMENTS: list[dict[str, str]] = [
    {},
    {"CUDA_DEVICE_MEMORY_LIMIT": "4Gi"},
    {"CUDA_DEVICE_MEMORY_LIMIT": "4g", "CUDA_DEVICE_MEMORY_LIMIT_1": "0"},
    {"CUDA_DEVICE_MEMORY_LIMIT_2": "512Mi", "CUDA_DEVICE_SM_LIMIT_63": "12.5"},
    {"CUDA_DEVICE_SM_LIMIT": "30%", "GPU_CORE_UTILIZATION_POLICY": "DEFAULT"},
    {"CUDA_DEVICE_SM_LIMIT": "100", "CUDA_DEVICE_SM_LIMIT_0": " 0.01 "},
    {"CUDA_DEVICE_SM_LIMIT": "30", "VGPU_COMPUTE_POLICY": "Elastic",
     "GPU_CORE_UTILIZATION_POLICY": "force"},
    {"CUDA_DEVICE_SM_LIMIT": "30", "GPU_CORE_UTILIZATION_POLICY": "disable",
     "CUDA_TASK_PRIORITY": "3"},
    {"VGPU_PRIORITY": "-2", "CUDA_TASK_PRIORITY": "3", "CUDA_DEVICE_MEMORY_LIMIT": "1G"},
    {"VGPU_PRIORITY": "", "CUDA_TASK_PRIORITY": "7"},
    {"CUDA_DISABLE_CONTROL": "TRUE", "CUDA_DEVICE_MEMORY_LIMIT": "1Gi"},
    {"CUDA_DISABLE_CONTROL": "0", "CUDA_DEVICE_MEMORY_LIMIT": "1Gi"},
]  # fmt: skip


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("CUDA_", "VGPU_", "GPU_CORE_", "LIBCUDA_"))}  # fmt: skip


def _harness_view(harness: Path, env: dict[str, str]) -> dict[str, int]:
    r = subprocess.run([str(harness), "enforced"], env={**_clean_env(), **env},
                       capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return {k: int(v) for k, v in (f.split("=") for f in r.stdout.split())}


@pytest.mark.parametrize(
    "env", ENVIRONMENTS, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "none"
)
def test_vgpu_run_resolves_what_the_shim_enforces(shim_harness: Path, env: dict[str, str]) -> None:
    """The shim's setup (config.c and compute_config.c, in the harness) and `vgpu run`'s view
    agree device by device, for every device index, policy and priority."""
    shim = _harness_view(shim_harness, env)
    view = enforced.resolve(env)
    assert view.disabled == bool(shim["disabled"])
    if view.disabled:
        return
    assert POLICY[view.policy] == shim["policy"] and view.priority == shim["priority"]
    assert len(view.memory) == len(view.cap_permille) == lib.VGPU_MAX_DEVICES
    assert list(view.memory) == [shim[f"mem{i}"] for i in range(lib.VGPU_MAX_DEVICES)]
    assert list(view.cap_permille) == [shim[f"cap{i}"] for i in range(lib.VGPU_MAX_DEVICES)]


def test_the_resolution_is_not_trivial() -> None:
    """The table above exercises defaults and precedences, not one constant answer."""
    views = [enforced.resolve(e) for e in ENVIRONMENTS]
    assert views[2].memory[:3] == (4 * GiB, 0, 4 * GiB)
    assert views[3].memory[2] == 512 << 20 and views[3].cap_permille[63] == 125
    assert views[4].policy == "elastic" and views[4].cap_permille[5] == 300
    assert views[5].cap_permille[:2] == (1, 0)
    assert views[6].policy == "elastic"
    assert (views[7].policy, views[7].priority) == ("off", 3) and not views[7].any_limit
    assert views[8].priority == -2 and views[9].priority == 7
    assert views[10].disabled and not views[11].disabled and views[11].memory[0] == GiB


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("CUDA_DEVICE_MEMORY_LIMIT", "4GB"),
        ("CUDA_DEVICE_MEMORY_LIMIT_64", "1Gi"),
        ("CUDA_DEVICE_SM_LIMIT", "300"),
        ("CUDA_DEVICE_SM_LIMIT_1", "-5"),
        ("VGPU_COMPUTE_POLICY", "strict"),
        ("GPU_CORE_UTILIZATION_POLICY", "hard"),
        ("CUDA_TASK_PRIORITY", "101"),
        ("CUDA_DISABLE_CONTROL", "maybe"),
    ],
)
def test_vgpu_run_refuses_what_the_shim_would_refuse_with_its_line(
    var: str, value: str, shim_ops: Path, shim_env: dict[str, str]
) -> None:
    """A setting the shim would refuse (cuInit fails in CMD) stops `vgpu run` before CMD starts,
    with the line the shim itself prints."""
    env = dict(shim_env, **{var: value})
    r = subprocess.run([str(shim_ops), "init"], env=env, capture_output=True, text=True,
                       timeout=60, check=True)  # fmt: skip
    assert parse_ops(r.stdout)[0]["rc"] == "1"
    (shim_line,) = [x for x in r.stderr.splitlines() if x.startswith("vgpu:")]
    run = subprocess.run(
        [sys.executable, "-m", "sharing.cli.main", "run", "--", "true"],
        env={**_clean_env(), var: value}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    (line,) = run.stderr.splitlines()
    assert line.startswith("vgpu run: the shim would refuse ")
    assert shim_line.endswith(line.removeprefix("vgpu run: the shim would refuse ")), (
        shim_line,
        line,
    )


def _show(*flags: str, env: dict[str, str] | None = None) -> list[str]:
    r = subprocess.run(
        [sys.executable, "-m", "sharing.cli.main", "run", "--show", *flags],
        env={**_clean_env(), **(env or {})}, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert r.stderr == ""
    return r.stdout.splitlines()


def test_show_prints_what_the_shim_would_enforce_without_running_cmd(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    assert _show("--memory", "4Gi", "--compute", "12.5", "--", "touch", str(marker)) == [
        "every device: memory 4.00 GiB, compute 12.5% (hard, priority 1)"
    ]
    assert not marker.exists()
    assert _show(
        "--memory", "4Gi", "--memory-1", "0", "--compute", "30", "--policy", "elastic"
    ) == [
        "device 0: memory 4.00 GiB, compute 30% (elastic, priority 1)",
        "device 1: memory no quota, compute 30% (elastic, priority 1)",
        "devices 2-63: memory 4.00 GiB, compute 30% (elastic, priority 1)",
    ]
    # the environment's settings count, with the shim's precedences (flags set the same names)
    assert _show("--compute", "30", env={"GPU_CORE_UTILIZATION_POLICY": "default",
                                         "CUDA_TASK_PRIORITY": "5"}) == [
        "every device: memory no quota, compute 30% (elastic, priority 5)"
    ]  # fmt: skip
    assert _show("--memory-0", "2Gi", "--compute", "40", "--policy", "off") == [
        "device 0: memory 2.00 GiB, compute uncapped (policy off: 40% not enforced)",
        "devices 1-63: memory no quota, compute uncapped (policy off: 40% not enforced)",
    ]
    assert _show() == ["no limit on any device (memory and compute unlimited)"]
    assert _show("--memory", "1Gi", env={"CUDA_DISABLE_CONTROL": "true"}) == [
        "nothing: CUDA_DISABLE_CONTROL=true (the shim passes every call through)"
    ]

"""The `vgpu` command and the build artefacts it points at, exercised as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sharing.paths import shim_library, sim_lib_dir

VGPU = [sys.executable, "-m", "sharing.cli"]


def _run(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*VGPU, *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_info_json_reports_paths_and_simulated_gpu(sim_env: dict[str, str]) -> None:
    res = _run(["info", "--json", "--sim"], env=sim_env)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert Path(report["shim"]).is_absolute() and Path(report["shim"]).is_file()
    sim_dir = Path(report["sim_lib_dir"])
    assert (sim_dir / "libcuda.so.1").is_file() and (sim_dir / "libnvidia-ml.so.1").is_file()
    assert report["version"]
    assert report["nvml_error"] is None
    [gpu] = report["gpus"]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["memory_total"] == 80 * 1024**3
    assert gpu["compute_capability"] == "9.0"
    assert gpu["uuid"].startswith("GPU-")


@pytest.mark.slow
def test_info_reports_configured_devices(sim_env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "sim.json"
    cfg.write_text(
        json.dumps(
            {
                "devices": [
                    {"name": "Sim A", "memory": "16Gi", "sm_count": 40},
                    {"name": "Sim B", "memory": "24Gi", "sm_count": 60},
                ]
            }
        )
    )
    res = _run(["info", "--json", "--sim"], env={**sim_env, "SIMGPU_CONFIG": str(cfg)})
    assert res.returncode == 0, res.stderr
    gpus = json.loads(res.stdout)["gpus"]
    assert [(g["name"], g["memory_total"]) for g in gpus] == [
        ("Sim A", 16 * 1024**3),
        ("Sim B", 24 * 1024**3),
    ]


@pytest.mark.slow
def test_info_without_nvml_says_so(tmp_path: Path) -> None:
    # No simulator and no driver on this machine: a clear line, not a traceback.
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    res = _run(["info"], env=env)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    if "NVML unavailable" not in res.stdout:
        pytest.skip("this machine has a real NVML")


def test_libraries_are_plain_c_with_their_sonames() -> None:
    libs = [shim_library(), sim_lib_dir() / "libcuda.so.1", sim_lib_dir() / "libnvidia-ml.so.1"]
    for lib in libs:
        ldd = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, check=True).stdout
        assert "libpython" not in ldd, ldd
        dyn = subprocess.run(
            ["readelf", "-d", str(lib)], capture_output=True, text=True, check=True
        )
        assert f"[{lib.name}]" in dyn.stdout  # SONAME
        assert "RPATH" not in dyn.stdout and "RUNPATH" not in dyn.stdout


@pytest.mark.slow
def test_demo_runs_and_shows_limits_held(sim_env: dict[str, str]) -> None:
    # The default compute phase (6 s), as a user runs it: a shorter one ends before the cap's NVML
    # loop has corrected what the events charge beside a busy neighbour (docs/compute.md).
    res = _run(["demo"], env=sim_env, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    # each tenant's CUDA context takes its share of the quota (the simulator's 500 MiB)
    ctx = "500.0 MiB of it its CUDA context's"
    assert f"team-a sees a 4.00 GiB GPU, {ctx}; got 3 x 1 GiB, the next was refused" in out
    assert f"team-b sees a 8.00 GiB GPU, {ctx}; got 7 x 1 GiB, the next was refused" in out
    assert "1.00 GiB denied, slice uses 3.49 GiB of 4.00 GiB" in out  # 3 GiB and the context
    assert "stayed within its caps" in out

"""The environment contract: accepted names and forms, fail closed on anything malformed,
passthrough without limits or with CUDA_DISABLE_CONTROL=true, refusal of unusable region files."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from sharing import region
from sharing.quantity import ACCEPTED_FORMS
from tests.support.shim_ops import parse_ops
from tests.support.staging import stage_shim_env

MiB = 1 << 20


def run(binary: Path, env: dict[str, str], *ops: str) -> tuple[list[dict[str, str]], list[str]]:
    r = subprocess.run(
        [str(binary), *ops], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return parse_ops(r.stdout), [x for x in r.stderr.splitlines() if x.startswith("vgpu:")]


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("CUDA_DEVICE_MEMORY_LIMIT", "abc"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "-1"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "-4Gi"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "4GB"),
        ("CUDA_DEVICE_MEMORY_LIMIT", ""),
        ("CUDA_DEVICE_MEMORY_LIMIT", "1.5"),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "lots"),
        ("CUDA_DEVICE_MEMORY_LIMIT_x", "1Gi"),
        ("CUDA_DEVICE_MEMORY_LIMIT_64", "1Gi"),  # past the 64 devices accounted
        ("CUDA_DEVICE_MEMORY_LIMIT", "99999999999999999999999"),
        ("LIBCUDA_LOG_LEVEL", "loud"),
        ("LIBCUDA_LOG_LEVEL", "-1"),
        ("CUDA_DISABLE_CONTROL", "maybe"),
        ("VGPU_CONTEXT_RESERVE", "-5"),
    ],
)
def test_malformed_values_fail_closed(
    var: str, value: str, shim_ops: Path, shim_env: dict[str, str]
) -> None:
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="1Gi")
    env[var] = value
    res, lines = run(shim_ops, env, "init", "alloc:1024", "info")
    assert res[0]["rc"] == "1"  # CUDA_ERROR_INVALID_VALUE
    assert res[1]["rc"] == "1" and res[2]["rc"] == "1"  # every hook fails closed, not unlimited
    assert len(lines) == 1, lines
    assert var in lines[0] and f'"{value}"' in lines[0] and "accepted" in lines[0]


def test_memory_error_lists_the_forms_python_accepts(
    shim_ops: Path, shim_env: dict[str, str]
) -> None:
    _, lines = run(shim_ops, dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="4GB"), "init")
    assert len(lines) == 1 and lines[0].endswith(f"accepted: {ACCEPTED_FORMS}"), lines


def test_no_limit_is_passthrough(
    shim_ops: Path, shim_env: dict[str, str], sim_env: dict[str, str]
) -> None:
    plain, _ = run(shim_ops, sim_env, "init", "ctx", "info")
    res, lines = run(shim_ops, shim_env, "init", "ctx", "info", f"alloc:{100 * MiB}")
    assert res[2]["total"] == plain[2]["total"]
    assert res[3]["rc"] == "0"
    assert lines == []


def test_disable_control_is_passthrough(
    shim_ops: Path, shim_env: dict[str, str], sim_env: dict[str, str]
) -> None:
    plain, _ = run(shim_ops, sim_env, "init", "ctx", "info")
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="not-even-valid", CUDA_DISABLE_CONTROL="true")
    res, lines = run(
        shim_ops, env, "init", "ctx", "info", f"alloc:{100 * MiB}", "dlsym_is:cuMemAlloc_v2"
    )
    assert res[0]["rc"] == "0" and res[3]["rc"] == "0"
    assert res[2]["total"] == plain[2]["total"]
    assert (res[4]["same"], res[4]["real"]) == ("0", "1")  # dlsym hands out the driver's function
    assert lines == []


@pytest.mark.parametrize(
    ("form", "expected"),
    [("1073741824", 1 << 30), ("1Gi", 1 << 30), ("1g", 1 << 30), ("1024m", 1 << 30), ("1G", 10**9),
     ("1048576k", 1 << 30), ("0.5Gi", 1 << 29)],
)  # fmt: skip
def test_accepted_forms(form: str, expected: int, shim_ops: Path, shim_env: dict[str, str]) -> None:
    res, _ = run(shim_ops, dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT=form), "init", "ctx", "info")
    assert res[2]["total"] == str(expected)


def test_per_device_overrides_all(shim_ops: Path, shim_env: dict[str, str]) -> None:
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="2Gi", CUDA_DEVICE_MEMORY_LIMIT_0="512Mi")
    res, _ = run(shim_ops, env, "init", "ctx", "info", "total:0")
    assert res[2]["total"] == str(512 * MiB)
    assert res[3]["total"] == str(512 * MiB)


def _corrupt(kind: str, path: Path) -> Path:
    if kind == "zeros":
        path.write_bytes(b"\0" * region.FILE_SIZE)
    elif kind == "short":
        path.write_bytes(b"VGPU")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "version":
        region.create(path)
        data = bytearray(path.read_bytes())
        data[4:8] = (99).to_bytes(4, "little")
        path.write_bytes(bytes(data))
    elif kind == "directory":
        path.mkdir()
    elif kind == "no-directory":
        return path / "missing-dir" / "slice.region"
    return path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("zeros", "wrong magic"),
        ("short", "size 4 bytes"),
        ("empty", "size 0 bytes"),
        ("version", "layout version 99"),
        ("directory", "is a directory"),
        ("no-directory", "its directory does not exist"),
    ],
)
def test_unusable_region_is_refused(
    kind: str, message: str, shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    path = _corrupt(kind, tmp_path / "slice.region")
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="1Gi", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(path))
    res, lines = run(shim_ops, env, "init", "alloc:1024")
    assert res[0]["rc"] != "0" and res[1]["rc"] != "0"
    assert len(lines) == 1 and message in lines[0] and str(path) in lines[0], lines


def test_region_without_permission_is_refused(shim_ops: Path, shim_env: dict[str, str]) -> None:
    """A user who may not write the region gets one clear line and a failing cuInit, no crash."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is needed to run as another user")
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        base.chmod(0o755)
        prog = base / "shim_ops"
        shutil.copy(shim_ops, prog)
        state = base / "state"
        state.mkdir()
        state.chmod(0o1777)  # the simulator refuses a shared directory without the sticky bit
        reg = base / "slice.region"
        region.create(reg, mode=0o644)  # readable by all, writable by its owner only
        env = dict(
            stage_shim_env(base, shim_env),  # the clone may be out of that user's reach
            CUDA_DEVICE_MEMORY_LIMIT="1Gi",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg),
            SIMGPU_STATE=str(state),
        )
        user = (
            []
            if os.geteuid() != 0
            else ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        )
        if not user and os.access(reg, os.W_OK):
            pytest.skip("cannot drop write permission for this user")
        r = subprocess.run([*user, str(prog), "init", "alloc:1024"], env=env, capture_output=True, text=True,
                           timeout=60, check=False)  # fmt: skip
        assert r.returncode == 0, r.stderr
        res = parse_ops(r.stdout)
        assert res[0]["rc"] == "304" and res[1]["rc"] == "304"  # CUDA_ERROR_OPERATING_SYSTEM
        lines = [x for x in r.stderr.splitlines() if x.startswith("vgpu:")]
        assert (
            len(lines) == 1
            and "cannot open read-write" in lines[0]
            and "Permission denied" in lines[0]
        ), lines


def test_limits_hold_with_only_libcuda(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """No libnvidia-ml.so.1 anywhere: the shim needs only the CUDA driver."""
    only = tmp_path / "only-libcuda"
    only.mkdir()
    shutil.copy(Path(shim_env["LD_LIBRARY_PATH"]) / "libcuda.so.1", only / "libcuda.so.1")
    env = dict(shim_env, LD_LIBRARY_PATH=str(only), CUDA_DEVICE_MEMORY_LIMIT="64Mi")
    res, lines = run(shim_ops, env, "init", "ctx", f"alloc:{48 * MiB}", f"alloc:{48 * MiB}", "info")
    assert [r["rc"] for r in res] == ["0", "0", "0", "2", "0"]
    assert res[4]["total"] == str(64 * MiB)
    assert len(lines) == 1 and "denied" in lines[0]

"""`vgpu run`'s per-user cache of a context's size (sharing/cli/context_cache.py): a --region slice
whose processes measured a context teaches it; later runs hand it to the shim as
VGPU_CONTEXT_SIZE; a cache anyone else could have written is ignored with one line."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sharing.cli.context_cache import ContextCache
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.shim_ops import parse_ops
from tests.support.vgpu_cli import vgpu_run

SHOW = ["--", "sh", "-c", 'echo "size=${VGPU_CONTEXT_SIZE:-none}"']


@pytest.fixture
def env(sim_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in sim_env.items() if k != "LD_LIBRARY_PATH"}
    e["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    return e


def cache_file(env: dict[str, str]) -> Path:
    return ContextCache.for_user(env).path


@pytest.mark.slow
def test_a_region_teaches_the_cache_and_later_runs_hand_it_over(
    shim_ops: Path, env: dict[str, str], tmp_path: Path
) -> None:
    reg = str(tmp_path / "slice.region")
    r = vgpu_run(["--sim", "--memory", "4Gi", "--", str(shim_ops), "init", "ctx"], env)
    assert r.returncode == 0, r.stderr
    assert not cache_file(env).exists()  # an anonymous slice teaches nothing
    r = vgpu_run(
        ["--sim", "--memory", "4Gi", "--region", reg, "--", str(shim_ops), "init", "ctx"], env
    )
    assert r.returncode == 0, r.stderr
    r = vgpu_run(["--sim", "--memory", "4Gi", "--region", reg, *SHOW], env)  # learns from the file
    assert r.stdout.strip() == f"size={CONTEXT_MEMORY}", r.stderr
    st = os.lstat(cache_file(env))
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.lstat(cache_file(env).parent).st_mode) == 0o700
    r = vgpu_run(["--sim", "--memory", "4Gi", *SHOW], env)  # any later run, no region
    assert r.stdout.strip() == f"size={CONTEXT_MEMORY}", r.stderr
    r = vgpu_run(["--sim", "--memory", "4Gi", "--", str(shim_ops), "init", "ctx"],
                 dict(env, LIBCUDA_LOG_LEVEL="4"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "charged 500.0 MiB (VGPU_CONTEXT_SIZE); 500.0 MiB measured" in r.stderr, r.stderr
    # the caller's own size wins
    r = vgpu_run(["--sim", "--memory", "4Gi", *SHOW], dict(env, VGPU_CONTEXT_SIZE="123"))
    assert r.stdout.strip() == "size=123"


@pytest.mark.slow
def test_a_hint_larger_than_the_context_settles_on_the_drivers_figure(
    shim_ops: Path, env: dict[str, str], tmp_path: Path
) -> None:
    """The cache learned 500 MiB from an earlier program; a program whose driver says its context
    takes nothing (SIMGPU_CONTEXT_MEMORY=0) is charged the hint at creation, then the driver's 0:
    it uses its whole 1 GiB slice, 8 x 128 MiB, as it does with a fresh cache (before, 4: the
    hint, 524 MiB free, for its whole life). The fifth allocation comes before or after the
    verification: refused meanwhile, it waits for it and is retried."""
    reg = str(tmp_path / "slice.region")
    teach = ["--sim", "--memory", "4Gi", "--region", reg, "--"]
    assert vgpu_run([*teach, str(shim_ops), "init", "ctx"], env).returncode == 0
    r = vgpu_run([*teach, "sh", "-c", 'echo "size=${VGPU_CONTEXT_SIZE:-none}"'], env)
    assert r.stdout.strip() == f"size={CONTEXT_MEMORY}", r.stderr  # the cache has it now
    ops = ["init", "ctx", *[f"alloc:{128 << 20}"] * 9, "info"]
    r = vgpu_run(
        ["--sim", "--memory", "1Gi", "--", str(shim_ops), *ops],
        dict(env, SIMGPU_CONTEXT_MEMORY="0", LIBCUDA_LOG_LEVEL="4"),
    )
    assert r.returncode == 0, r.stderr
    res = parse_ops(r.stdout)
    assert [x["rc"] for x in res[2:11]] == ["0"] * 8 + ["2"], (res, r.stderr)
    assert res[11]["used"] == str(1 << 30), res
    assert "the driver took 0 B, less than VGPU_CONTEXT_SIZE (500.0 MiB): charging 0 B" in r.stderr


def plant(env: dict[str, str], how: str, tmp_path: Path) -> None:
    path = cache_file(env)
    path.parent.mkdir(parents=True, mode=0o700)
    text = '{"anything": 1048576}'
    if how == "group-writable file":
        path.write_text(text)
        path.chmod(0o620)
    elif how == "link to a file":
        other = tmp_path / "elsewhere.json"
        other.write_text(text)
        other.chmod(0o600)
        path.symlink_to(other)
    elif how == "other-writable directory":
        path.write_text(text)
        path.chmod(0o600)
        path.parent.chmod(0o777)
    elif how == "directory is a link":
        real = tmp_path / "realdir"
        real.mkdir(mode=0o700)
        (real / path.name).write_text(text)
        (real / path.name).chmod(0o600)
        path.parent.rmdir()
        path.parent.symlink_to(real)
    elif how == "file of another user":
        if os.geteuid() != 0:
            pytest.skip("needs root to give a file to another user")
        path.write_text(text)
        path.chmod(0o600)
        os.chown(path, 65534, 65534)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("group-writable file", "writable by group or others (mode 620)"),
        ("link to a file", "cannot open without following links"),
        ("other-writable directory", "writable by group or others (mode 777)"),
        ("directory is a link", "not a directory reachable without links"),
        ("file of another user", "owned by uid 65534, not this user"),
    ],
)
def test_a_cache_someone_else_could_write_is_ignored(
    how: str, says: str, env: dict[str, str], tmp_path: Path
) -> None:
    plant(env, how, tmp_path)
    r = vgpu_run(["--sim", "--memory", "4Gi", *SHOW], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "size=none"
    lines = [x for x in r.stderr.splitlines() if x.startswith("vgpu run:")]
    assert len(lines) == 1 and "context-size cache ignored" in lines[0] and says in lines[0], (
        r.stderr
    )

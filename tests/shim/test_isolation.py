"""Tenant isolation of the shim (docs/shim.md, "Threat model"): each test performs an attack.

- The plugin's read-only limits file is the only source of limits when present: a tenant's
  environment (kill switches, other limits, another accounting file) changes nothing.
- Only the plugin's file counts: a read-only bind mount of its own (here made in a private mount
  namespace, as the container runtime does from the CDI spec). A file named `limits` on a
  writable file system, beside a copy of the shim, or the plugin's mounts moved aside by the
  tenant's root (`mv` of their directory): the shim fails closed.
- The writable accounting file holds no limit: rewriting it cannot lift the quota.
- No file is opened through a link another user planted, nor taken from another user's
  directory: the link's target stays byte-for-byte unchanged.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sharing._region_cffi import ffi

from sharing import region
from sharing.limitsfile import render_limits_file
from sharing.paths import shim_library
from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support.shim_ops import parse_ops

pytestmark = NO_CONTEXT_MEMORY


MiB = 1 << 20
NOBODY = 65534

# Every way a tenant's environment could try to lift or move the limits.
HOSTILE_ENV = {
    "CUDA_DISABLE_CONTROL": "1",
    "CUDA_DEVICE_MEMORY_LIMIT": "0",
    "CUDA_DEVICE_MEMORY_LIMIT_0": "1Ti",
    "CUDA_DEVICE_SM_LIMIT": "",
    "CUDA_DEVICE_SM_LIMIT_0": "0",
    "VGPU_COMPUTE_POLICY": "off",
    "GPU_CORE_UTILIZATION_POLICY": "disable",
    "VGPU_CONTEXT_RESERVE": "0",
}


def run(
    binary: Path, env: dict[str, str], *ops: str, setup: str = "", wrapper: Path | None = None
) -> tuple[list[dict[str, str]], list[str]]:
    """shim_ops with `ops`; `setup`: shell commands run first in a private mount namespace;
    `wrapper`: a program that runs shim_ops (without_statx)."""
    argv = [str(binary), *ops]
    if wrapper is not None:
        argv = [str(wrapper), *argv]
    if setup:
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f'{setup} && exec "$@"', "sh", *argv]  # fmt: skip
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True)
    return parse_ops(r.stdout), [x for x in r.stderr.splitlines() if x.startswith("vgpu:")]


def mount_ro(*files: Path) -> str:
    """Shell commands: each file bind-mounted read-only onto itself (what CDI's mounts do)."""
    return " && ".join(f"mount --bind -o ro {shlex.quote(str(f))} {shlex.quote(str(f))}"
                       for f in files)  # fmt: skip


@pytest.fixture
def shim_dir(tmp_path: Path) -> Path:
    """A copy of the shim in a directory of its own (the plugin's layout: the tests mount it and
    a limits file beside it read-only with plugin_mounts)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): the plugin's files are read-only bind mounts")
    d = tmp_path / "vgpu-sharing"
    d.mkdir()
    shutil.copy(shim_library(), d / "libvgpu.so")
    return d


def plugin_mounts(shim_dir: Path) -> str:
    return mount_ro(shim_dir / "libvgpu.so", shim_dir / "limits")


def write_limits(shim_dir: Path, text: str) -> Path:
    p = shim_dir / "limits"
    p.write_text(text)
    p.chmod(0o444)
    return p


def complete(memory: int, acct: Path, **extra: str) -> str:
    """A limits file as the plugin writes it (every required key), with extra entries."""
    text = render_limits_file(
        memory_limits=[memory], sm_limits=[100], policy="hard", priority=1, shared_cache=str(acct)
    )
    return text + "".join(f"{k}={v}\n" for k, v in extra.items())


@pytest.fixture(params=["statx", "without statx"])
def mount_check(request: pytest.FixtureRequest, build_c: Callable[..., Path]) -> Path | None:
    """How the shim tells the plugin's bind mount: statx's mount-root attribute (Linux 5.8), or,
    where statx answers ENOSYS (older kernels, older seccomp profiles), /proc/self/mountinfo."""
    return build_c("without_statx.c") if request.param == "without statx" else None


def test_limits_file_overrides_every_tenant_setting(
    shim_ops: Path,
    shim_env: dict[str, str],
    shim_dir: Path,
    tmp_path: Path,
    mount_check: Path | None,
) -> None:
    acct = tmp_path / "acct"
    write_limits(shim_dir, complete(64 * MiB, acct))
    elsewhere = tmp_path / "tenant.region"
    env = dict(shim_env, **HOSTILE_ENV, LD_PRELOAD=str(shim_dir / "libvgpu.so"))
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(elsewhere)
    res, lines = run(shim_ops, env, "init", "ctx", "info", f"alloc:{48 * MiB}", f"alloc:{32 * MiB}",
                     setup=plugin_mounts(shim_dir), wrapper=mount_check)  # fmt: skip
    assert [r["rc"] for r in res] == ["0", "0", "0", "0", "2"]  # the second is over 64 MiB
    assert res[2]["total"] == str(64 * MiB)
    # The slice's accounting file is the plugin's, not the one the tenant named.
    assert acct.exists() and not elsewhere.exists()
    ignored = [x for x in lines if "limits come from" in x]
    assert len(ignored) == 1, lines
    for name in HOSTILE_ENV:
        assert name in ignored[0]
    assert "CUDA_DEVICE_MEMORY_SHARED_CACHE" in ignored[0]


def test_the_file_s_own_values_in_the_environment_are_not_warned_about(
    shim_ops: Path, shim_env: dict[str, str], shim_dir: Path, tmp_path: Path
) -> None:
    """The plugin's CDI spec sets the limits in the environment too, to the file's values (for
    tools that read them): no warning for those; a value that differs is still named."""
    acct = tmp_path / "acct"
    write_limits(shim_dir, complete(64 * MiB, acct))
    agreeing = {"CUDA_DEVICE_MEMORY_LIMIT_0": str(64 * MiB), "CUDA_DEVICE_SM_LIMIT_0": "100",
                "VGPU_COMPUTE_POLICY": "hard", "VGPU_PRIORITY": "1",
                "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(acct)}  # fmt: skip
    env = dict(shim_env, **agreeing, LD_PRELOAD=str(shim_dir / "libvgpu.so"))
    res, lines = run(shim_ops, env, "init", "ctx", "info", setup=plugin_mounts(shim_dir))
    assert [r["rc"] for r in res] == ["0", "0", "0"] and res[2]["total"] == str(64 * MiB)
    assert not [x for x in lines if "limits come from" in x], lines
    env["VGPU_PRIORITY"] = "0"  # differs from the file's 1
    res, lines = run(shim_ops, env, "init", setup=plugin_mounts(shim_dir))
    assert [r["rc"] for r in res] == ["0"]
    (line,) = [x for x in lines if "limits come from" in x]
    assert line.endswith("ignoring the environment's VGPU_PRIORITY"), line


def test_limits_file_still_ignores_the_kill_switch(
    shim_ops: Path, shim_env: dict[str, str], shim_dir: Path, tmp_path: Path
) -> None:
    """CUDA_DISABLE_CONTROL=1 from the tenant: not honoured when the plugin's file is there."""
    write_limits(shim_dir, complete(16 * MiB, tmp_path / "acct"))
    env = dict(shim_env, CUDA_DISABLE_CONTROL="1", LD_PRELOAD=str(shim_dir / "libvgpu.so"))
    res, _ = run(shim_ops, env, "init", "ctx", f"alloc:{32 * MiB}", setup=plugin_mounts(shim_dir))
    assert res[2]["rc"] == "2"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"CUDA_DEVICE_MEMORY_LIMIT_1": "lots"}, "CUDA_DEVICE_MEMORY_LIMIT_1=lots invalid"),
        ({"just words": ""}, "not a KEY=VALUE line"),
        ({"CUDA_DEVICE_SM_LIMIT_64": "30"}, "key CUDA_DEVICE_SM_LIMIT_64 unknown"),
        ({"CUDA_DISABLE_CONTROL": "1"}, "key CUDA_DISABLE_CONTROL unknown"),
        ({"CUDA_DEVICE_MEMORY_LIMIT_1": "1"}, "must name the same devices"),
    ],
)
def test_a_bad_limits_file_fails_closed(
    shim_ops: Path,
    shim_env: dict[str, str],
    shim_dir: Path,
    tmp_path: Path,
    content: dict[str, str],
    message: str,
) -> None:
    text = complete(MiB, tmp_path / "acct", **content).replace("just words=\n", "just words\n")
    write_limits(shim_dir, text)
    env = dict(shim_env, CUDA_DISABLE_CONTROL="1", LD_PRELOAD=str(shim_dir / "libvgpu.so"))
    res, lines = run(shim_ops, env, "init", f"alloc:{MiB}", setup=plugin_mounts(shim_dir))
    assert res[0]["rc"] == "1" and res[1]["rc"] != "0"
    assert len(lines) == 1 and message in lines[0], lines


def test_a_limits_file_behind_a_link_fails_closed(
    shim_ops: Path, shim_env: dict[str, str], shim_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "generous"
    other.write_text("CUDA_DEVICE_MEMORY_LIMIT=0\n")
    (shim_dir / "limits").symlink_to(other)
    env = dict(shim_env, LD_PRELOAD=str(shim_dir / "libvgpu.so"))
    res, lines = run(shim_ops, env, "init", f"alloc:{MiB}")
    assert res[0]["rc"] == "1"
    assert len(lines) == 1 and "limits file" in lines[0], lines


GENEROUS = "CUDA_DISABLE_CONTROL=1\n"


def test_a_limits_file_on_a_writable_file_system_is_not_the_plugins(
    shim_ops: Path, shim_env: dict[str, str], shim_dir: Path
) -> None:
    """A tenant's own file beside a copy of the shim: fails closed, whatever it says."""
    write_limits(shim_dir, GENEROUS)
    env = dict(shim_env, LD_PRELOAD=str(shim_dir / "libvgpu.so"))
    res, lines = run(shim_ops, env, "init", "ctx", f"alloc:{MiB}")
    assert res[0]["rc"] == "1" and res[2]["rc"] != "0", res
    assert len(lines) == 1 and "not the plugin's: it is on a writable file system" in lines[0], (
        lines
    )


def test_a_read_only_directory_is_not_a_mount_of_its_own(
    shim_ops: Path, shim_env: dict[str, str], shim_dir: Path, mount_check: Path | None
) -> None:
    """Read-only is not enough (an image's files under readOnlyRootFilesystem are read-only):
    the file must be a bind mount of its own, as only the runtime makes from the CDI spec."""
    write_limits(shim_dir, GENEROUS)
    env = dict(shim_env, LD_PRELOAD=str(shim_dir / "libvgpu.so"))
    res, lines = run(shim_ops, env, "init", "ctx", f"alloc:{MiB}", setup=mount_ro(shim_dir),
                     wrapper=mount_check)  # fmt: skip
    assert res[0]["rc"] == "1" and res[2]["rc"] != "0", res
    assert len(lines) == 1 and "not a read-only mount of its own" in lines[0], lines


MOVE_ASIDE = "mv {d} {d}.old && mkdir {d} && cp {d}.old/libvgpu.so {d}/"


@pytest.mark.parametrize(
    ("forged", "preload", "expected"),
    [
        # the attack: a copy of the shim and a limits file of the tenant's in a new
        # directory where the plugin's was
        (True, "new", "not the plugin's: it is on a writable file system"),
        # the same without a limits file: the environment's kill switch would rule
        (False, "new", "the plugin's limits are mounted at {d}.old/limits, not beside this shim"),
        # the plugin's shim, moved with its directory: its limits are still beside it
        (False, "old", None),
    ],
)
def test_moving_the_plugins_mounts_aside(
    shim_ops: Path,
    shim_env: dict[str, str],
    shim_dir: Path,
    forged: bool,
    preload: str,
    expected: str | None,
) -> None:
    """Container root renames the directory holding the plugin's read-only mounts (allowed: it
    is not itself a mount point) and puts its own in its place."""
    write_limits(shim_dir, complete(16 * MiB, shim_dir.parent / "acct"))
    d = shlex.quote(str(shim_dir))
    setup = plugin_mounts(shim_dir) + " && " + MOVE_ASIDE.format(d=d)
    if forged:
        setup += f" && printf 'CUDA_DISABLE_CONTROL=1\\n' > {d}/limits"
    lib = shim_dir / "libvgpu.so" if preload == "new" else Path(f"{shim_dir}.old") / "libvgpu.so"
    env = dict(shim_env, CUDA_DISABLE_CONTROL="1", LD_PRELOAD=str(lib))
    res, lines = run(shim_ops, env, "init", "ctx", f"alloc:{32 * MiB}", setup=setup)
    if expected is None:
        assert res[0]["rc"] == "0" and res[2]["rc"] == "2", (res, lines)  # over the 16 MiB
        return
    assert res[0]["rc"] == "1" and res[2]["rc"] != "0", (res, lines)
    assert len(lines) == 1 and expected.format(d=shim_dir) in lines[0], lines


def test_rewriting_the_accounting_file_cannot_lift_the_quota(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """The accounting file is writable by every process of the slice; it holds no limit."""
    reg = tmp_path / "slice.region"
    region.create(reg)
    assert "limit" not in {f[0] for f in ffi.typeof("struct vgpu_device_account").fields}
    # Everything but the lock and the process slots: zeros, then all ones.
    devices = ffi.offsetof("struct vgpu_region", "devices")
    end = ffi.offsetof("struct vgpu_region", "procs")
    for fill in (0x00, 0xFF):
        with reg.open("r+b") as f:
            f.seek(devices)
            f.write(bytes([fill]) * (end - devices))
        env = dict(
            shim_env, CUDA_DEVICE_MEMORY_LIMIT="64Mi", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg)
        )
        res, _ = run(shim_ops, env, "init", "ctx", f"alloc:{100 * MiB}")
        # more than the quota on its own: refused whatever the file says
        assert res[2]["rc"] == "2", fill


# ---------------------------------------------------------------- planted links


def as_nobody(*cmd: str) -> None:
    subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd],
        check=True,
        timeout=30,
    )


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory like /tmp (1777, root's) that an unprivileged attacker can reach."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip(
            "needs root and setpriv: the attack is an unprivileged user against a root process"
        )
    base = Path("/tmp") / f"vgpu-isolation-{os.getpid()}"
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    d = base / "shared"
    d.mkdir()
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def target(shared_dir: Path) -> Path:
    """A root-owned file an attacker would like to corrupt (the size of an accounting file)."""
    t = shared_dir.parent / "precious"
    t.write_bytes(os.urandom(region.FILE_SIZE))
    t.chmod(0o644)
    return t


@pytest.mark.slow
def test_planted_link_at_the_accounting_file_is_refused(
    shim_ops: Path, shim_env: dict[str, str], shared_dir: Path, target: Path
) -> None:
    before = target.read_bytes()
    link = shared_dir / "slice.region"
    as_nobody("ln", "-s", str(target), str(link))
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="64Mi", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(link))
    res, lines = run(shim_ops, env, "init", "ctx", f"alloc:{MiB}")
    assert res[0]["rc"] == "1" and res[2]["rc"] != "0"
    assert len(lines) == 1 and "symbolic link" in lines[0], lines
    assert target.read_bytes() == before
    # `vgpu run --region` refuses it too, with one line.
    r = subprocess.run(
        [sys.executable, "-m", "sharing.cli", "run", "--sim", "--memory", "64Mi", "--region",
         str(link), "--", "true"],
        env=shim_env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "symbolic link" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert target.read_bytes() == before


def test_accounting_file_planted_by_another_user_is_refused(
    shim_ops: Path, shim_env: dict[str, str], shared_dir: Path
) -> None:
    """A valid-looking file the attacker prepared (and can rewrite) is not used by root."""
    planted = shared_dir / "slice.region"
    prep = shared_dir / "prep.region"
    region.create(prep, mode=0o666)
    as_nobody("cp", str(prep), str(planted))
    env = dict(
        shim_env, CUDA_DEVICE_MEMORY_LIMIT="64Mi", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(planted)
    )
    res, lines = run(shim_ops, env, "init")
    assert res[0]["rc"] == "1"
    assert len(lines) == 1 and f"belongs to uid {NOBODY}" in lines[0], lines


def test_planted_node_state_directory_is_refused(
    build_c: Callable[..., Path], shim_env: dict[str, str], shared_dir: Path, target: Path
) -> None:
    """The default demand directory ($XDG_RUNTIME_DIR/vgpu-node here, /tmp/vgpu-node-<uid>
    without it) planted as a link to the attacker's directory, or made by the attacker."""
    workload = build_c("compute_workload.c")
    before = target.read_bytes()
    trap = shared_dir / "trap"
    as_nobody("mkdir", str(trap))
    planted = ["0" * 16 + ".demand", "compute.state"]
    for name in planted:
        as_nobody("ln", "-s", str(target), str(trap / name))
    as_nobody("ln", "-s", str(trap), str(shared_dir / "vgpu-node"))
    env = dict(
        shim_env,
        CUDA_DEVICE_SM_LIMIT="30",
        VGPU_COMPUTE_POLICY="elastic",
        XDG_RUNTIME_DIR=str(shared_dir),
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(shared_dir.parent / "root.region"),
    )
    cmd = [str(workload), "--warmup", "0", "--seconds", "0.3"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr  # the cap holds; only lending is off
    assert "node state" in r.stderr and "refused" in r.stderr, r.stderr
    assert sorted(p.name for p in trap.iterdir()) == sorted(planted)
    assert target.read_bytes() == before
    # A real directory of the attacker's in its place: refused as well, nothing written there.
    (shared_dir / "vgpu-node").unlink()
    as_nobody("mkdir", str(shared_dir / "vgpu-node"))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and f"belongs to uid {NOBODY}" in r.stderr, r.stderr
    assert list((shared_dir / "vgpu-node").iterdir()) == []


def test_planted_link_at_the_simulator_state_is_refused(
    shim_ops: Path, sim_env: dict[str, str], shared_dir: Path, target: Path
) -> None:
    """The simulated driver keeps node-wide state too: same rules for its files."""
    before = target.read_bytes()
    state = shared_dir
    # Learn the state file's name from a harmless run in a directory of our own, then plant it.
    own = shared_dir.parent / "own-state"
    own.mkdir(mode=0o700)
    env = dict(sim_env, SIMGPU_STATE=str(own))
    run(shim_ops, env, "init", "ctx")
    (name,) = [p.name for p in own.iterdir() if p.name.startswith("state-") and "." not in p.name]
    as_nobody("ln", "-s", str(target), str(state / name))
    as_nobody("ln", "-s", str(target), str(state / f"{name}.pids"))  # the host-PID locks' file
    env = dict(sim_env, SIMGPU_STATE=str(state))
    r = subprocess.run(
        [str(shim_ops), "init", "ctx"], env=env, capture_output=True, text=True, timeout=60
    )
    assert parse_ops(r.stdout)[0]["rc"] != "0"
    assert target.read_bytes() == before
    # A state directory that belongs to the attacker: refused.
    theirs = shared_dir / "theirs"
    as_nobody("mkdir", str(theirs))
    env = dict(sim_env, SIMGPU_STATE=str(theirs))
    r = subprocess.run([str(shim_ops), "init"], env=env, capture_output=True, text=True, timeout=60)
    assert parse_ops(r.stdout)[0]["rc"] != "0" and "another user" in r.stderr
    assert list(theirs.iterdir()) == []

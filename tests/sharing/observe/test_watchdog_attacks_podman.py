"""A hostile tenant, root in its container (podman + runc from the plugin's CDI spec, a PID
namespace of its own as a pod has), against the watchdog and the plugin's read-only mounts
(docs/shim.md, "Threat model"). Each test performs the attack; the `vgpu exporter` on the host
runs the watchdog with --enforce kill over the plugin's data directory.

- A link to another claim's shared directory named as the accounting file: the watchdog never
  blames that claim (it attributes by the files a process has, or resolves strictly inside the
  process's root) and still stops the process.
- The directory of the plugin's mounts moved aside and replaced by a copy of the shim with a
  limits file of the tenant's: the copy fails closed (no allocation over the quota).
- /etc moved aside (no /etc/ld.so.preload): the program runs without the shim; the watchdog
  reports and stops it.
- A copy of the shim preloaded instead of the plugin's: the watchdog knows the plugin's shim by
  device and inode, reports the copy as no shim and stops the process, under its quota too.
- A limits file of the tenant's bind-mounted over the plugin's in a user + mount namespace of its
  own (unshare -Urm), with the claim's hash written into its slot: the watchdog resolves the file
  the shim reads in the process's own namespace, and it is not the claim's.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sharing._region_cffi import ffi

from sharing import region
from sharing.observe.watchdog import fnv1a64
from sharing.paths import sim_lib_dir
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer
from tests.support.observers import ExporterProcess, only, scrape
from tests.support.podman_containers import (
    SIGNAL,
    Podman,
    bypass_in_rootfs,
    copy_with_deps,
    missing_cuda,
    rootfs,
    wait_held,
    world,
)

__all__ = ["bypass_in_rootfs", "rootfs", "world"]  # fixtures used by name
pytestmark = pytest.mark.slow
MiB = 1 << 20
GiB = 1 << 30
TOOLS = ("ln", "mv", "mkdir", "cp", "rm", "unshare", "mount")
SHIM_DIR = "/usr/local/lib/vgpu-sharing"
World = tuple[FakeApiServer, KubeletStandin, Path, Podman]


@pytest.fixture
def tools(rootfs: Path, bypass_in_rootfs: str) -> Iterator[Path]:
    """coreutils the tenant uses, in the container's root (with their libraries)."""
    if why := missing_cuda():
        pytest.skip(why)
    paths = [Path(shutil.which(t) or f"/bin/{t}").resolve() for t in TOOLS]
    added = [rootfs / "bin" / t for t in TOOLS if not (rootfs / "bin" / t).exists()]
    for t, path in zip(TOOLS, paths, strict=True):
        if not (rootfs / "bin" / t).exists():
            shutil.copy2(path, rootfs / "bin" / t)
    copy_with_deps(paths, rootfs, dict(os.environ))
    yield rootfs
    for f in added:
        f.unlink()


def _overlay(cmd: list[str], rootfs: Path) -> list[str]:
    """The container writes to an overlay of the shared root (its renames stay its own)."""
    i = cmd.index("--rootfs")
    assert cmd[i + 1] == str(rootfs)
    return [*cmd[: i + 1], f"{rootfs}:O", *cmd[i + 2 :]]


def _shell(podman: Podman, rootfs: Path, cdi_id: str, script: str, overlay: bool = True
           ) -> list[str]:  # fmt: skip
    cmd = podman.command(cdi_id, "-c", script, program="/bin/sh")
    assert "--pid" not in cmd  # a PID namespace of its own, as a pod's
    return _overlay(cmd, rootfs) if overlay else cmd


@pytest.fixture
def etc_restored(tools: Path) -> Iterator[Path]:
    """For attacks that rename /etc: the overlay refuses to rename a directory of its lower layer
    (EXDEV), a pod's root file system does not; so they run on the root itself, repaired after."""
    yield tools
    old = tools / "etc.old"
    if old.is_dir():
        shutil.rmtree(tools / "etc", ignore_errors=True)
        old.rename(tools / "etc")
    (tools / "tmp" / "libvgpu.so").unlink(missing_ok=True)


def _claim(server: FakeApiServer, kubelet: KubeletStandin, name: str, ns: str, memory: str
           ) -> tuple[str, str]:  # fmt: skip
    c = claim_id(server.put(allocated_claim(name, namespace=ns,
                                            results=[result("gpu", "gpu-0", memory=memory)])))  # fmt: skip
    [cdi_id] = kubelet.prepare([c])[c.uid].devices[0].cdi_device_ids
    return c.uid, cdi_id


def _exporter(root: Path, podman: Podman) -> ExporterProcess:
    env = dict(os.environ, SIMGPU_STATE=str(podman.sim_state), LD_LIBRARY_PATH=str(sim_lib_dir()))
    env.pop("SIMGPU_CONFIG", None)
    return ExporterProcess(["--sim", "--data-dir", str(root / "data"), "--enforce", "kill",
                            "--watchdog-margin", "16Mi"], env)  # fmt: skip


def _violations(url: str, uid: str, metric: str = "vgpu_slice_quota_violations_total") -> float:
    got = only(scrape(url), metric, claim_uid=uid)
    return got[0].value if got else 0.0


def _wait(pred: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.3)
    return False


def _end(box: subprocess.Popen[str] | None) -> None:
    """A container the watchdog failed to stop is not left holding the GPU (failure path)."""
    if box is not None and box.poll() is None:
        box.kill()
        box.communicate(timeout=60)


def _out(box: subprocess.Popen[str]) -> str:
    """What a container said, once it has ended (killed if need be)."""
    if box.poll() is None:
        box.kill()
    out, err = box.communicate(timeout=60)
    return f"exit {box.returncode}: {out} {err}"


def _held(box: subprocess.Popen[str]) -> None:
    assert box.stdout is not None
    line = box.stdout.readline()
    assert line.strip() == "held rc=0", (line, box.stderr.read() if box.stderr else "")


@pytest.mark.parametrize("b_memory", ["4Gi", "1Gi"])
def test_a_link_to_another_claims_directory_blames_nobody_else(
    world: World, tools: Path, bypass_in_rootfs: str, b_memory: str
) -> None:
    """The issue's attack: container A links /tmp/l to claim B's shared directory on the host,
    names /tmp/l/accounting as its accounting file and holds 2.6 GB through a renamed copy of
    the driver. Before: with B at 4 GiB nobody was flagged; with B at 1 GiB team-b was blamed."""
    server, kubelet, root, podman = world
    _, a_cdi = _claim(server, kubelet, "attacker", "team-a", "1Gi")
    b_uid, _ = _claim(server, kubelet, "victim", "team-b", b_memory)
    b_shared = root / "data" / "claims" / b_uid / "shared"
    assert (b_shared / "accounting").exists()
    exp = _exporter(root, podman)
    box: subprocess.Popen[str] | None = None
    try:
        script = (f"ln -sfn {b_shared} /tmp/l && "
                  "export CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/l/accounting && "
                  f"exec {bypass_in_rootfs} {2600 * 1000 * 1000}")  # fmt: skip
        box = subprocess.Popen(_shell(podman, tools, a_cdi, script), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        _held(box)
        box.wait(40)  # stopped by the watchdog (SIGTERM ends the program and the container)
        assert box.returncode != 0
        time.sleep(2.5)  # two more passes: nothing is put on B later either
        assert _violations(exp.url, b_uid) == 0
        assert _violations(exp.url, b_uid, "vgpu_slice_processes_without_shim") == 0
    finally:
        _end(box)
        log = exp.stop()
    assert "stopping pids" in log, log
    assert "team-b" not in log and b_uid not in log, log
    # attributed to its own claim (the files it has), or to none (its named file is out of reach)
    assert "claim team-a/attacker" in log or "belongs to no slice" in log, log


def test_a_copy_of_the_shim_with_limits_of_its_own_fails_closed(world: World, tools: Path) -> None:
    """mv /usr/local/lib/vgpu-sharing aside (it is not a mount point, its files are), a new
    directory with a copy of libvgpu.so and a limits file saying CUDA_DISABLE_CONTROL=1: before,
    a 3 GiB allocation succeeded in a 1 GiB claim."""
    server, kubelet, _, podman = world
    _, cdi = _claim(server, kubelet, "mover", "team-a", "1Gi")
    script = (f"mv {SHIM_DIR} /usr/local/lib/old && mkdir {SHIM_DIR} && "
              f"cp /usr/local/lib/old/libvgpu.so {SHIM_DIR}/ && "
              f"printf 'CUDA_DISABLE_CONTROL=1\\n' > {SHIM_DIR}/limits && "
              f"exec /bin/e2e_claim_quota alloc {3 * GiB}")  # fmt: skip
    p = subprocess.run(_shell(podman, tools, cdi, script), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert "alloc=0" not in p.stdout, (p.stdout, p.stderr)
    assert p.returncode == 2 and "cuInit(0) failed" in p.stderr, (p.returncode, p.stderr)
    assert f"{SHIM_DIR}/limits" in p.stderr and "not the plugin's" in p.stderr, p.stderr
    # without the forged file, the copy finds the plugin's mounts moved and fails closed too
    script = (f"mv {SHIM_DIR} /usr/local/lib/old && mkdir {SHIM_DIR} && "
              f"cp /usr/local/lib/old/libvgpu.so {SHIM_DIR}/ && "
              f"CUDA_DISABLE_CONTROL=1 exec /bin/e2e_claim_quota alloc {3 * GiB}")  # fmt: skip
    p = subprocess.run(_shell(podman, tools, cdi, script), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode == 2 and "/usr/local/lib/old/limits" in p.stderr, (p.stdout, p.stderr)


def test_the_preload_moved_away_is_caught_and_stopped(world: World, etc_restored: Path) -> None:
    """mv /etc /etc.old; mkdir /etc: no /etc/ld.so.preload, the program runs without the shim
    and its 3 GiB allocation succeeds in a 1 GiB claim. The watchdog reports the claim's process
    without the shim and stops it."""
    server, kubelet, root, podman = world
    uid, cdi = _claim(server, kubelet, "unloaded", "team-a", "1Gi")
    exp = _exporter(root, podman)
    box: subprocess.Popen[str] | None = None
    try:
        script = ("mv /etc /etc.old && mkdir /etc && "
                  f"exec /bin/e2e_claim_quota hold {3 * GiB} /tmp")  # fmt: skip
        box = subprocess.Popen(_shell(podman, etc_restored, cdi, script, overlay=False),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        _, err = box.communicate(timeout=60)
        assert box.returncode != 0, err  # stopped, not released after its 60 s
        # reported as a process without the shim, whether or not a pass saw it over its quota
        assert _violations(exp.url, uid, "vgpu_slice_processes_without_shim") in (0.0, 1.0)
    finally:
        _end(box)
        log = exp.stop()
    lines = [x for x in log.splitlines() if "process without the shim" in x]
    assert lines and "claim team-a/unloaded" in lines[0], log
    assert "the shim is not loaded into it" in lines[0]
    assert "stopping pids" in log


def test_a_copy_of_the_shim_is_no_shim_to_the_watchdog(
    world: World, etc_restored: Path, bypass_in_rootfs: str
) -> None:
    """/etc moved away and a copy of libvgpu.so preloaded in its place (a tenant's build could
    do anything): under its quota the process holds 256 MiB through a driver copy. Before, any
    mapping named libvgpu counted as the shim, so nothing was reported."""
    server, kubelet, root, podman = world
    uid, cdi = _claim(server, kubelet, "copier", "team-a", "1Gi")
    exp = _exporter(root, podman)
    box: subprocess.Popen[str] | None = None
    try:
        script = (f"cp {SHIM_DIR}/libvgpu.so /tmp/libvgpu.so && mv /etc /etc.old && mkdir /etc && "
                  f"LD_PRELOAD=/tmp/libvgpu.so exec {bypass_in_rootfs} {256 * MiB}")  # fmt: skip
        box = subprocess.Popen(_shell(podman, etc_restored, cdi, script, overlay=False),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        _held(box)
        box.wait(40)
        assert box.returncode != 0
        assert _violations(exp.url, uid) == 0  # under its quota: no quota violation
    finally:
        _end(box)
        log = exp.stop()
    lines = [x for x in log.splitlines() if "process without the shim" in x]
    assert lines and "claim team-a/copier" in lines[0], log
    assert "/tmp/libvgpu.so" in lines[0] and "not the plugin's shim" in lines[0], lines
    assert "stopping pids" in log


def test_the_previous_shim_after_an_upgrade_is_still_the_shim(world: World, tools: Path) -> None:
    """Not an attack: a new plugin version replaces <data-dir>/lib/libvgpu.so (by rename) while a
    container maps the previous copy, which its namespace still has mounted. A watchdog started
    after the replacement never saw that copy's inode and must not call the process shimless."""
    server, kubelet, root, podman = world
    uid, cdi = _claim(server, kubelet, "upgraded", "team-a", "1Gi")
    box = podman.start(cdi, "hold", str(256 * MiB), SIGNAL)  # the test's channel to the container
    exp: ExporterProcess | None = None
    try:
        wait_held(box, podman.signal)
        lib = root / "data" / "lib" / "libvgpu.so"
        new = lib.with_name("libvgpu.so.new")
        shutil.copy2(lib, new)
        os.replace(new, lib)  # what the plugin's install_shim does for a changed shim
        exp = _exporter(root, podman)
        assert _wait(lambda: bool(only(scrape(exp.url), "vgpu_device_memory_used_bytes")
                                  and only(scrape(exp.url), "vgpu_device_memory_used_bytes")[0].value
                                  >= 256 * MiB))  # fmt: skip
        time.sleep(3.5)  # three watchdog passes over the process
        assert box.poll() is None
        assert _violations(exp.url, uid, "vgpu_slice_processes_without_shim") == 0
        (podman.signal / "release").touch()
        box.communicate(timeout=60)
        assert box.returncode == 0
    finally:
        _end(box)
        log = exp.stop() if exp is not None else ""
    assert "process without the shim" not in log and "stopping pids" not in log, log


def test_a_mount_of_its_own_over_the_limits_is_caught_whatever_its_slot_says(
    world: World, tools: Path
) -> None:
    """Issue 33, attack 2. podman's default seccomp profile lets container root make a user and
    mount namespace (unshare -Urm); there it bind-mounts a limits file of its own (the claim's,
    with 8 GiB and the compute cap off) over the plugin's and remounts it read-only, which the shim
    cannot tell from the plugin's mount. It then writes the claim's hash into its slot of the
    accounting file (its own to write), so the shim's word says nothing is wrong. Before, the
    watchdog believed the slot and saw nothing."""
    server, kubelet, root, podman = world
    uid, cdi = _claim(server, kubelet, "forger", "team-a", "1Gi")
    limits = root / "data" / "claims" / uid / "limits"
    accounting = root / "data" / "claims" / uid / "shared" / "accounting"
    exp = _exporter(root, podman)
    box: subprocess.Popen[str] | None = None
    try:
        inner = (f"mount --bind /tmp/forged {SHIM_DIR}/limits && "
                 f"mount -o remount,bind,ro {SHIM_DIR}/limits && "
                 f"exec /bin/e2e_claim_quota hold {256 * MiB} /tmp")  # fmt: skip
        # the claim's own limits with 8 GiB and no compute cap
        forge = ('while IFS= read -r l; do case "$l" in '
                 f'CUDA_DEVICE_MEMORY_LIMIT_0=*) echo CUDA_DEVICE_MEMORY_LIMIT_0={8 * GiB};; '
                 'VGPU_COMPUTE_POLICY=*) echo VGPU_COMPUTE_POLICY=off;; '
                 '*) printf "%s\\n" "$l";; esac; '
                 f'done < {SHIM_DIR}/limits > /tmp/forged')  # fmt: skip
        script = f"{forge} && exec unshare -Urm sh -c '{inner}'"
        box = subprocess.Popen(_shell(podman, tools, cdi, script), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert _wait(lambda: any(s.source == region.LIMITS_FILE
                                 for s in region.read_slot_limits(accounting))), _out(box)  # fmt: skip
        # the forgery worked inside: the shim enforces the tenant's file...
        [slot] = region.read_slot_limits(accounting)
        genuine = fnv1a64(limits.read_bytes())
        assert slot.hash != genuine
        # ...and the tenant makes its slot say the claim's file
        at = (ffi.offsetof("struct vgpu_region", "procs")
              + slot.slot * ffi.sizeof("struct vgpu_proc_slot")
              + ffi.offsetof("struct vgpu_proc_slot", "limits_hash"))  # fmt: skip
        fd = os.open(accounting, os.O_WRONLY)
        try:
            os.pwrite(fd, struct.pack("=Q", genuine), at)
        finally:
            os.close(fd)
        assert region.read_slot_limits(accounting)[0].hash == genuine
        box.wait(40)
        assert box.returncode != 0  # stopped
        assert _violations(exp.url, uid) == 0  # under its quota: no quota violation
    finally:
        _end(box)
        log = exp.stop()
    lines = [x for x in log.splitlines() if "process without the shim" in x]
    assert lines and "claim team-a/forger" in lines[0], log
    assert f"the limits file its shim reads ({SHIM_DIR}/limits) is not the claim's" in lines[0]
    assert "stopping pids" in log

"""End to end with a real CDI consumer: the plugin prepares claims over the real kubelet gRPC
sockets, and podman + runc start containers from the CDI specs it wrote. Inside, a C program on
the simulated GPU (through the shim, preloaded by the spec's /etc/ld.so.preload mount) checks
the claim's quota: cuMemGetInfo_v2 shows the slice, an over-quota cuMemAlloc_v2 fails, two
containers of one claim share one quota, and a second claim on the same GPU has its own.

podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi, so podman runs in a private
mount namespace where the plugin's CDI root is bind-mounted over /var/run/cdi (the host's
/var/run/cdi is left alone). The container root filesystem is built in a temporary directory.

Skips (with the reason) when podman, runc, unshare, gcc or root are missing, or when the shim or
the simulator are not built with the CUDA entry points the program needs.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sharing.paths import sim_lib_dir
from tests.driver.kubelet_standin import (
    DRIVER,
    ClaimId,
    KubeletStandin,
    allocated_claim,
    claim_id,
    result,
)
from tests.driver.plugin_process import PluginProcess
from tests.fakes.apiserver import FakeApiServer
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.podman_containers import (
    CUDA_ERROR_OUT_OF_MEMORY,
    RUNC,
    SIGNAL,
    Podman,
    missing_cuda,
    rootfs,
    value_of,
    wait_held,
    world,
)

__all__ = ["rootfs", "world"]  # fixtures used by name
pytestmark = pytest.mark.slow

MiB = 1024**2
GiB = 1024**3


def test_cdi_edits_reach_the_container(
    world: tuple[FakeApiServer, KubeletStandin, Path, Podman],
) -> None:
    """Env, the preload file, the shim and the writable claim directory, as podman applies them
    (no CUDA needed: runs a shell)."""
    server, kubelet, root, podman = world
    c = claim_id(server.put(allocated_claim("c", results=[result("gpu", "gpu-0", memory="3Gi",
                                                                 cores="40")])))  # fmt: skip
    [cdi_id] = kubelet.prepare([c])[c.uid].devices[0].cdi_device_ids
    script = (
        'echo "visible=$CUDA_VISIBLE_DEVICES mem=$CUDA_DEVICE_MEMORY_LIMIT_0 '
        "sm=$CUDA_DEVICE_SM_LIMIT_0 cache=$CUDA_DEVICE_MEMORY_SHARED_CACHE "
        'policy=$VGPU_COMPUTE_POLICY"; cat /etc/ld.so.preload; '
        "test -r /usr/local/lib/vgpu-sharing/libvgpu.so && echo shim=present; "
        "test -w /run/vgpu-sharing/accounting && echo accounting=writable; "
        "cat /usr/local/lib/vgpu-sharing/limits; "
        "echo y > /usr/local/lib/vgpu-sharing/limits || echo limits=readonly; "
        "echo z > /run/vgpu-node/other.demand || echo node=readonly; "
        "echo d > /run/vgpu-demand && echo demand=writable"
    )
    out = podman.run(cdi_id, "-c", script, program="/bin/sh")
    spec = json.loads((root / "cdi" / f"k8s.{DRIVER}-claim_{c.uid}.json").read_text())
    spec_env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
    assert f"visible={spec_env['CUDA_VISIBLE_DEVICES']} " in out
    assert spec_env["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
    assert f"mem={3 * GiB} sm=40 cache=/run/vgpu-sharing/accounting policy=hard" in out
    assert "/usr/local/lib/vgpu-sharing/libvgpu.so" in out
    assert "shim=present" in out and "accounting=writable" in out
    # The limits file is there and read-only; the node's demand records are read-only; the
    # claim's own demand record is writable.
    assert f"CUDA_DEVICE_MEMORY_LIMIT_0={3 * GiB}\nCUDA_DEVICE_SM_LIMIT_0=40\n" in out
    assert "limits=readonly" in out and "node=readonly" in out and "demand=writable" in out
    claim_dir = root / "data" / "claims" / c.uid
    assert (root / "data" / "node-state" / f"{c.uid}.demand").read_text() == "d\n"
    assert not (root / "data" / "node-state" / "other.demand").exists()
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" in (claim_dir / "limits").read_text()
    assert kubelet.unprepare([c]) == {c.uid: ""}


def test_device_metadata_file_is_readable_and_read_only_in_the_container(
    world: tuple[FakeApiServer, KubeletStandin, Path, Podman],
) -> None:
    """The claim's device metadata (KEP-5304) at its standard path, as podman mounts it from the
    CDI spec: the workload reads its quota there; root in the container cannot change it."""
    server, kubelet, root, podman = world
    c = claim_id(server.put(allocated_claim("meta", results=[result("gpu", "gpu-0", memory="3Gi",
                                                                    cores="40")])))  # fmt: skip
    [cdi_id] = kubelet.prepare([c])[c.uid].devices[0].cdi_device_ids
    path = f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/meta/gpu/{DRIVER}-metadata.json"
    script = (
        f"cat {path}; echo; "
        f"(echo x > {path}) 2>/dev/null && echo metadata=writable || echo metadata=readonly; "
        f"rm -f {path} 2>/dev/null; test -f {path} && echo metadata=kept"
    )
    out = podman.run(cdi_id, "-c", script, program="/bin/sh")
    first = json.JSONDecoder().raw_decode(out)[0]
    assert first["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
    [req] = first["requests"]
    [dev] = req["devices"]
    assert dev["name"] == "gpu-0"
    assert dev["attributes"]["memoryLimit"] == {"int": 3 * GiB}
    assert dev["attributes"]["smLimit"] == {"int": 40}
    assert "metadata=readonly" in out and "metadata=kept" in out, out
    host = root / "data" / "claims" / c.uid / "metadata" / "gpu.json"
    assert json.JSONDecoder().raw_decode(host.read_text())[0] == first  # unchanged on the host
    assert kubelet.unprepare([c]) == {c.uid: ""}


def test_the_tenant_cannot_add_rename_or_replace_files_in_the_claims_dir(
    world: tuple[FakeApiServer, KubeletStandin, Path, Podman],
) -> None:
    """Container root attacks the claim's accounting mount: a deep tree and files beside the
    accounting file, renaming, deleting and replacing it. Only the file itself is mounted (a
    single-file bind mount): nothing reaches the host's claim directory, the file stays the
    plugin's, and unprepare removes everything."""
    server, kubelet, root, podman = world
    c = claim_id(server.put(allocated_claim("c", results=[result("gpu", "gpu-0")])))
    [cdi_id] = kubelet.prepare([c])[c.uid].devices[0].cdi_device_ids
    shared = root / "data" / "claims" / c.uid / "shared"
    before = (shared / "accounting").stat()
    script = (
        "cd /run/vgpu-sharing || exit 9; "
        "i=0; while [ $i -lt 200 ]; do mkdir d && cd d || break; i=$((i+1)); done; "
        "cd /run/vgpu-sharing; echo x > beside; "
        "(echo y > /run/vgpu-sharing/new) 2>/dev/null; "
        "mv accounting moved 2>/dev/null && echo renamed=yes || echo renamed=no; "
        "rm -f accounting 2>/dev/null; test -e accounting && echo kept=yes; "
        "echo z > /tmp/fake && (mv /tmp/fake accounting 2>/dev/null && echo replaced=yes "
        "|| echo replaced=no)"
    )
    out = podman.run(cdi_id, "-c", script, program="/bin/sh")
    assert "renamed=no" in out and "kept=yes" in out and "replaced=no" in out, out
    # the host's claim directory holds the accounting file, the same one, and nothing else
    assert sorted(p.name for p in shared.iterdir()) == ["accounting"]
    after = (shared / "accounting").stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755 and shared.stat().st_uid == 0
    assert kubelet.unprepare([c]) == {c.uid: ""}
    assert not (root / "data" / "claims" / c.uid).exists()


def test_containers_see_and_share_the_claims_quota(
    world: tuple[FakeApiServer, KubeletStandin, Path, Podman],
) -> None:
    if why := missing_cuda():
        pytest.skip(why)
    server, kubelet, root, podman = world
    # 2 GiB: each container's CUDA context (500 MiB on the simulator) is charged to the claim too
    a = claim_id(server.put(allocated_claim("a", results=[result("gpu", "gpu-0", memory="2Gi")])))
    b = claim_id(server.put(allocated_claim("b", results=[result("gpu", "gpu-0", memory="2Gi")])))
    out = kubelet.prepare([a, b])
    assert out[a.uid].error == "" and out[b.uid].error == "", out
    [id_a] = out[a.uid].devices[0].cdi_device_ids
    [id_b] = out[b.uid].devices[0].cdi_device_ids

    info = podman.run(id_a, "info")
    assert value_of(info, "total") == 2 * GiB
    assert 0 < value_of(info, "free") <= 2 * GiB - CONTEXT_MEMORY  # its own context is charged
    assert value_of(podman.run(id_a, "alloc", str(2 * GiB)), "alloc") == CUDA_ERROR_OUT_OF_MEMORY

    # Container 1 of claim a holds 700 MiB and its context ...
    holder = podman.start(id_a, "hold", str(700 * MiB), SIGNAL)
    try:
        wait_held(holder, podman.signal)
        # ... so container 2 of the same claim cannot get another 700 MiB (one quota) ...
        assert (
            value_of(podman.run(id_a, "alloc", str(700 * MiB)), "alloc") == CUDA_ERROR_OUT_OF_MEMORY
        )
        assert value_of(podman.run(id_a, "alloc", str(200 * MiB)), "alloc") == 0
        # ... while claim b on the same GPU has its own quota.
        assert value_of(podman.run(id_b, "alloc", str(700 * MiB)), "alloc") == 0
    finally:
        (podman.signal / "release").touch()
        holder.wait(60)
    assert holder.returncode == 0, holder.stderr.read()  # type: ignore[union-attr]

    assert kubelet.unprepare([a, b]) == {a.uid: "", b.uid: ""}
    assert list((root / "cdi").iterdir()) == []


def test_unprepared_claim_is_unknown_to_podman(
    world: tuple[FakeApiServer, KubeletStandin, Path, Podman],
) -> None:
    """After unprepare the CDI device is gone: the runtime refuses to start the container."""
    server, kubelet, _root, podman = world
    c = claim_id(server.put(allocated_claim("c", results=[result("gpu", "gpu-0", memory="1Gi")])))
    [cdi_id] = kubelet.prepare([c])[c.uid].devices[0].cdi_device_ids
    assert "ok" in podman.run(cdi_id, "-c", "echo ok", program="/bin/sh")
    assert kubelet.unprepare([ClaimId(c.namespace, c.name, c.uid)]) == {c.uid: ""}
    p = subprocess.run(podman.command(cdi_id, "-c", "echo ok", program="/bin/sh"),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode != 0
    assert "unresolvable CDI devices" in p.stderr or cdi_id in p.stderr, p.stderr


# Every environment override a tenant could try against the plugin's limits.
HOSTILE_ENV = (
    "export CUDA_DISABLE_CONTROL=1 CUDA_DEVICE_SM_LIMIT_0=0 CUDA_DEVICE_SM_LIMIT=0 "
    "VGPU_COMPUTE_POLICY=off GPU_CORE_UTILIZATION_POLICY=disable "
    "CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/elsewhere CUDA_DEVICE_MEMORY_LIMIT={limit}; "
)


@pytest.mark.parametrize("memory_override", ["unset", "huge"])
def test_environment_overrides_do_not_lift_the_claims_quota(
    world: tuple[FakeApiServer, KubeletStandin, Path, Podman], memory_override: str
) -> None:
    """A container given the claim's CDI device sets CUDA_DISABLE_CONTROL=1, unsets (or raises)
    CUDA_DEVICE_MEMORY_LIMIT_0, sets CUDA_DEVICE_SM_LIMIT_0=0, VGPU_COMPUTE_POLICY=off and points
    CUDA_DEVICE_MEMORY_SHARED_CACHE elsewhere: it still gets the claim's quota, shared with the
    claim's other containers through the plugin's accounting file."""
    if why := missing_cuda():
        pytest.skip(why)
    server, kubelet, _root, podman = world
    # 2 GiB: a context (500 MiB on the simulator) and 700 MiB fit once, not twice
    c = claim_id(server.put(allocated_claim("c", results=[result("gpu", "gpu-0", memory="2Gi",
                                                                 cores="30")])))  # fmt: skip
    [cdi_id] = kubelet.prepare([c])[c.uid].devices[0].cdi_device_ids
    if memory_override == "unset":
        hostile = HOSTILE_ENV.format(limit="") + "unset CUDA_DEVICE_MEMORY_LIMIT_0; "
    else:
        hostile = HOSTILE_ENV.format(limit="1Ti") + "export CUDA_DEVICE_MEMORY_LIMIT_0=1Ti; "
    script = hostile + 'exec /bin/e2e_claim_quota "$@"'

    def run(*args: str) -> str:
        return podman.run(cdi_id, "-c", script, "sh", *args, program="/bin/sh")

    assert value_of(run("info"), "total") == 2 * GiB
    assert value_of(run("alloc", str(2 * GiB)), "alloc") == CUDA_ERROR_OUT_OF_MEMORY
    # A hostile container holds 700 MiB: a well-behaved one of the same claim sees it (the
    # accounting file is the claim's, whatever CUDA_DEVICE_MEMORY_SHARED_CACHE says).
    holder = podman.start(cdi_id, "-c", script, "sh", "hold", str(700 * MiB), SIGNAL,
                          program="/bin/sh")  # fmt: skip
    try:
        wait_held(holder, podman.signal)
        assert (
            value_of(podman.run(cdi_id, "alloc", str(700 * MiB)), "alloc")
            == CUDA_ERROR_OUT_OF_MEMORY
        )
    finally:
        (podman.signal / "release").touch()
        holder.wait(60)
    assert kubelet.unprepare([c]) == {c.uid: ""}


def _sim_driver_version(env: dict[str, str]) -> str:
    probe = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlSystemGetDriverVersion())"
    env = dict(env, LD_LIBRARY_PATH=str(sim_lib_dir()))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout  # fmt: skip
    return out.strip()


def _fake_driver_root(root: Path, version: str) -> Path:
    """A driver root holding the simulator's libraries as the NVIDIA installer lays a driver out:
    lib*.so.<version> files with soname links, and an nvidia-smi."""
    lib = root / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    for soname in ("libcuda.so.1", "libnvidia-ml.so.1"):
        real = soname.replace(".so.1", f".so.{version}")
        shutil.copy2(sim_lib_dir() / soname, lib / real)
        (lib / soname).symlink_to(real)
    (root / "usr" / "bin").mkdir(parents=True)
    smi = root / "usr" / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho nvidia-smi stand-in\n")
    smi.chmod(0o755)
    return root


def test_driver_libraries_injected_without_the_nvidia_runtime(rootfs: Path) -> None:
    """CDI alone (no NVIDIA runtime hook, no LD_LIBRARY_PATH): the plugin mounts the driver's
    libcuda.so.1 (the simulator's, standing in) found under the driver root, and the shim in the
    container enforces the claim's quota with it. With the NVIDIA Container Toolkit's CDI spec
    present, the claim answers with the toolkit's device instead."""
    if why := missing_cuda():
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="vgi", dir="/tmp"))
    sim_state = root / "simgpu-state"
    sim_state.mkdir()
    sim_env = dict(os.environ, SIMGPU_STATE=str(sim_state))
    sim_env.pop("SIMGPU_CONFIG", None)
    version = _sim_driver_version(sim_env)
    driver_root = _fake_driver_root(root / "driver", version)
    try:
        with FakeApiServer() as server:
            plugin = PluginProcess(root, server.url, simulator_env=sim_env,
                                   extra_args=("--driver-root", str(driver_root)))  # fmt: skip
            plugin.start()
            kubelet = KubeletStandin(root / "registry" / f"{DRIVER}-reg.sock")
            kubelet.register()
            try:
                c = claim_id(server.put(allocated_claim("c", results=[
                    result("gpu", "gpu-0", memory="1Gi")])))  # fmt: skip
                [cdi_id] = kubelet.prepare([c])[c.uid].devices[0].cdi_device_ids
                podman = [
                    "podman", "--runtime", RUNC, "--cgroup-manager=cgroupfs", "run", "--rm",
                    "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
                    "--network", "none", "--device", cdi_id,
                    "-v", f"{sim_state}:{sim_state}", "-e", f"SIMGPU_STATE={sim_state}",
                    "--rootfs", str(rootfs),
                ]  # fmt: skip
                script = 'mkdir -p /var/run/cdi && mount --bind "$0" /var/run/cdi && exec "$@"'
                ns = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                      str(root / "cdi")]  # fmt: skip
                shell = ('echo "ld=${LD_LIBRARY_PATH:-unset} nvd=$NVIDIA_VISIBLE_DEVICES"; '
                         "/usr/bin/nvidia-smi; exec /bin/e2e_claim_quota info")  # fmt: skip
                p = subprocess.run([*ns, *podman, "/bin/sh", "-c", shell], capture_output=True,
                                   text=True, timeout=120)  # fmt: skip
                assert p.returncode == 0, p.stderr[-2000:]
                assert "ld=unset nvd=void" in p.stdout
                assert "nvidia-smi stand-in" in p.stdout
                assert value_of(p.stdout, "total") == GiB  # libcuda.so.1 loaded, quota enforced

                # The toolkit's spec for this GPU on the node: its device id is returned instead.
                uuid = json.loads((root / "cdi" / f"k8s.{DRIVER}-claim_{c.uid}.json").read_text())[
                    "devices"][0]["containerEdits"]["env"]  # fmt: skip
                gpu_uuid = dict(e.split("=", 1) for e in uuid)["CUDA_VISIBLE_DEVICES"]
                (root / "cdi-static").mkdir()
                (root / "cdi-static" / "nvidia.json").write_text(json.dumps({
                    "cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
                    "devices": [{"name": gpu_uuid, "containerEdits": {}}]}))  # fmt: skip
                d = claim_id(server.put(allocated_claim("d", results=[
                    result("gpu", "gpu-0", memory="1Gi")])))  # fmt: skip
                ids = kubelet.prepare([d])[d.uid].devices[0].cdi_device_ids
                assert list(ids) == [f"k8s.{DRIVER}/claim={d.uid}", f"nvidia.com/gpu={gpu_uuid}"]
                spec = json.loads((root / "cdi" / f"k8s.{DRIVER}-claim_{d.uid}.json").read_text())
                env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
                assert env["NVIDIA_VISIBLE_DEVICES"] == gpu_uuid  # not ours to inject: no void
                assert kubelet.unprepare([c, d]) == {c.uid: "", d.uid: ""}
            finally:
                kubelet.close()
                plugin.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)

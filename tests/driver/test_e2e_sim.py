"""`vgpu-kubelet-plugin --sim` end to end, as deploy/overlays/sim runs it on a node without GPUs:
the console script as a real process, given nothing but its flags (no LD_LIBRARY_PATH, no
SIMGPU_* variables), against the fake API server; a kubelet stand-in prepares claims over the
real sockets and podman + runc start containers from the CDI specs the plugin wrote, with no
extra volume or variable. The container's root filesystem has no CUDA library: libcuda.so.1 and
libnvidia-ml.so.1 (the packaged simulator), the simulated node's device file and the claim's own
simulator state directory all come from the claim's CDI spec. Inside, the test program sees its
claim's quota and is refused past it; the plugin's NVML sees every claim's processes on the
simulated GPU. A tenant that wrecks its own simulated device (truncates or overwrites its state,
stops a process holding the simulator's lock) harms neither another claim's GPU process nor the
plugin (its metrics keep answering).

Skips (with the reason) like tests/driver/test_e2e_podman.py: podman, runc, unshare, gcc, root.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.contextsize import CACHE_FILE
from driver.injection import SIM_CONFIG_PATH, SIM_STATE_PATH, multiarch_lib_dir
from sharing.limitsfile import parse_limits_file
from sharing.paths import sim_lib_dir
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.cbuild import compile_program
from tests.support.podman_containers import (
    CUDA_ERROR_OUT_OF_MEMORY,
    RUNC,
    copy_with_deps,
    missing_cuda,
    missing_tools,
    value_of,
    wait_held,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PLUGIN = Path(sys.executable).parent / "vgpu-kubelet-plugin"
DRIVER = "vgpu.sharing.dev"
NODE = "node-a"  # the kubelet stand-in's claims are allocated on node-a
MiB = 1024**2
GiB = 1024**3


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sh, cat and the test program with their C library: no CUDA library at all."""
    why = missing_tools() or missing_cuda()
    if why:
        pytest.skip(why)
    rootfs = tmp_path_factory.mktemp("simrootfs")
    (rootfs / "bin").mkdir()
    program = compile_program(REPO / "tests" / "c" / "e2e_claim_quota.c",
                              tmp_path_factory.mktemp("cbin"))  # fmt: skip
    # the attacker's tool: takes the simulator's state lock (or a device scheduler's) in the
    # claim's state and stops itself holding it
    locker = compile_program(REPO / "tests" / "c" / "sim_die_locked.c",
                             tmp_path_factory.mktemp("cbin"))  # fmt: skip
    files = [program, locker]
    shutil.copy2(program, rootfs / "bin" / "e2e_claim_quota")
    shutil.copy2(locker, rootfs / "bin" / "sim_die_locked")
    for tool in ("sh", "cat", "ls", "sleep"):
        path = Path(shutil.which(tool) or f"/bin/{tool}").resolve()
        shutil.copy2(path, rootfs / "bin" / tool)
        files.append(path)
    for d in ("etc", "tmp", "run", "proc", "sys", "dev"):
        (rootfs / d).mkdir(exist_ok=True)
    copy_with_deps(files, rootfs, dict(os.environ, LD_LIBRARY_PATH=str(sim_lib_dir())))
    assert not list(rootfs.rglob("libcuda*")) and not list(rootfs.rglob("libnvidia-ml*"))
    return rootfs


class SimPlugin:
    """The console script with --sim, every path under root, as the DaemonSet runs it."""

    def __init__(self, server: FakeApiServer, root: Path, *flags: str) -> None:
        self.root = root
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", "KUBECONFIG")
            and not k.startswith("SIMGPU_")
        }
        env.update(
            NODE_NAME=NODE,
            KUBECONFIG=str(server.kubeconfig_path(root)),
            CDI_ROOT=str(root / "cdi"),
            KUBELET_REGISTRAR_DIRECTORY_PATH=str(root / "reg"),
            KUBELET_PLUGINS_DIRECTORY_PATH=str(root / "plugins"),
            DATA_DIR=str(root / "data"),
            SHARING_MODE="sharing",
            REDISCOVER_INTERVAL="30s",
        )
        self.log = (root / "plugin.log").open("w+")
        self.proc = subprocess.Popen(
            [str(PLUGIN), "--sim", *flags], env=env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def output(self) -> str:
        self.log.flush()
        return (self.root / "plugin.log").read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


def devices(server: FakeApiServer) -> list[dict[str, Any]]:
    return [d for s in server.objects("ResourceSlice") for d in s["spec"].get("devices") or []]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def world(
    rootfs: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[FakeApiServer, SimPlugin, KubeletStandin, Path]]:
    """The plugin (flags beyond the simulated node's from an indirect parameter), the fake API
    server, the kubelet stand-in, the test's root directory."""
    extra: tuple[str, ...] = getattr(request, "param", ())
    root = Path(tempfile.mkdtemp(prefix="vgs", dir="/tmp"))  # short: unix socket paths
    try:
        with FakeApiServer() as server:
            server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
            plugin = SimPlugin(server, root, "--sim-gpus", "2", "--sim-model", "l4", *extra)
            try:
                deadline = time.monotonic() + 60
                while len(devices(server)) < 2:
                    assert plugin.proc.poll() is None, plugin.output()
                    assert time.monotonic() < deadline, plugin.output()
                    time.sleep(0.1)
                kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
                kubelet.register()
                try:
                    yield server, plugin, kubelet, root
                finally:
                    kubelet.close()
            finally:
                plugin.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def podman(
    root: Path, rootfs: Path, cdi_id: str, *args: str, volumes: tuple[str, ...] = ()
) -> list[str]:
    """podman + runc with the claim's CDI device and nothing else (but the test's `volumes`);
    the plugin's CDI root is bind-mounted over /var/run/cdi in a private mount namespace
    (podman reads only there)."""
    cmd = [
        "podman", "--runtime", RUNC, "--cgroup-manager=cgroupfs", "run", "--rm",
        "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "--network", "none",
        "--device", cdi_id, *(f"--volume={v}" for v in volumes), "--rootfs", str(rootfs), *args,
    ]  # fmt: skip
    script = 'mkdir -p /var/run/cdi && mount --bind "$0" /var/run/cdi && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
            str(root / "cdi"), *cmd]  # fmt: skip


def run(root: Path, rootfs: Path, cdi_id: str, *args: str) -> str:
    p = subprocess.run(podman(root, rootfs, cdi_id, *args), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode == 0, f"container {args} failed ({p.returncode}): {p.stderr[-6000:]}"
    return p.stdout


def prepare(server: FakeApiServer, kubelet: KubeletStandin, name: str, memory: str) -> str:
    c = claim_id(server.put(allocated_claim(name, results=[result("gpu", "gpu-0",
                                                                  memory=memory)])))  # fmt: skip
    answer = kubelet.prepare([c])[c.uid]
    assert answer.error == "", answer.error
    [cdi_id] = answer.devices[0].cdi_device_ids
    return cdi_id


def node_memory_used(data: Path) -> int:
    """Device 0's used memory as NVML reports it to a process set up as the plugin's own NVML
    (its state, every claim's observed): a fresh process, the simulator's view."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(sim_lib_dir()),
               SIMGPU_CONFIG=str(data / "sim" / "config.json"),
               SIMGPU_STATE=str(data / "sim" / "plugin-state"),
               SIMGPU_OBSERVE=f"{data / 'claims'}/*/sim")  # fmt: skip
    probe = ("import pynvml; pynvml.nvmlInit(); "
             "print(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    return int(out)


def wait_learned(root: Path) -> None:
    """Until the plugin learned the context size in the background (its cache file is written
    after the helper exited and the plugin shared the state files the helper created)."""
    learned = root / "data" / CACHE_FILE
    deadline = time.monotonic() + 120
    while not learned.exists():
        assert time.monotonic() < deadline, "the plugin never learned the context size"
        time.sleep(0.05)


def test_sim_plugin_publishes_the_simulated_node(
    world: tuple[FakeApiServer, SimPlugin, KubeletStandin, Path],
) -> None:
    server, plugin, _kubelet, root = world
    devs = devices(server)
    assert [d["name"] for d in devs] == ["gpu-0", "gpu-1"]
    assert {d["attributes"]["productName"]["string"] for d in devs} == {"NVIDIA L4"}
    assert {d["attributes"]["brand"]["string"] for d in devs} == {"Nvidia"}  # NVML's, as an L4's
    uuids = {d["attributes"]["uuid"]["string"] for d in devs}
    assert len(uuids) == 2  # derived from the node name: distinct between nodes too
    config = json.loads((root / "data" / "sim" / "config.json").read_text())
    assert {d["uuid"] for d in config["devices"]} == uuids
    # The plugin's own simulator state (its NVML and its context-size helper's) is its alone:
    # no claim mounts it.
    state = root / "data" / "sim" / "plugin-state"
    assert state.stat().st_mode & 0o7777 == 0o700
    wait_learned(root)
    files = list(state.iterdir())
    assert files and all(f.stat().st_mode & 0o077 == 0 for f in files)
    assert "simulated GPUs (2 x NVIDIA L4)" in plugin.output()


def test_container_gets_the_simulated_driver_from_the_cdi_spec_alone(
    world: tuple[FakeApiServer, SimPlugin, KubeletStandin, Path], rootfs: Path
) -> None:
    server, _plugin, kubelet, root = world
    cdi_id = prepare(server, kubelet, "look", "1Gi")
    lib = multiarch_lib_dir()
    out = run(root, rootfs, cdi_id, "/bin/sh", "-c",
              f'echo "cfg=$SIMGPU_CONFIG state=$SIMGPU_STATE ld=${{LD_LIBRARY_PATH:-unset}}"; '
              f"ls {lib}/libcuda.so.1 {lib}/libnvidia-ml.so.1 {SIM_CONFIG_PATH}; "
              f"cat {SIM_CONFIG_PATH}")  # fmt: skip
    assert f"cfg={SIM_CONFIG_PATH} state={SIM_STATE_PATH} ld=unset" in out
    assert f"{lib}/libcuda.so.1" in out and "NVIDIA L4" in out
    spec = json.loads(next((root / "cdi").glob("*.json")).read_text())
    mounts = {m["containerPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}
    data = root / "data"
    assert mounts[f"{lib}/libcuda.so.1"]["hostPath"] == str(data / "sim" / "lib" / "libcuda.so.1")
    assert "ro" in mounts[f"{lib}/libcuda.so.1"]["options"]
    assert "ro" in mounts[SIM_CONFIG_PATH]["options"]
    # the claim's own simulator state, writable: nothing of another claim's or the plugin's
    [claim_dir] = (data / "claims").iterdir()
    assert mounts[SIM_STATE_PATH]["hostPath"] == str(claim_dir / "sim")
    assert (claim_dir / "sim").stat().st_mode & 0o7777 == 0o1777
    assert "rw" in mounts[SIM_STATE_PATH]["options"]
    writable = [m["hostPath"] for m in mounts.values() if "rw" in m["options"]]
    assert all(p.startswith(str(claim_dir)) or "node-state" in p for p in writable), writable


def test_claims_see_their_quota_and_share_one_simulated_gpu(
    world: tuple[FakeApiServer, SimPlugin, KubeletStandin, Path], rootfs: Path
) -> None:
    server, _plugin, kubelet, root = world
    # 2 GiB: each container's CUDA context (500 MiB on the simulator) is charged to its claim
    a = prepare(server, kubelet, "a", "2Gi")
    b = prepare(server, kubelet, "b", "2Gi")
    info = run(root, rootfs, a, "/bin/e2e_claim_quota", "info")
    assert value_of(info, "total") == 2 * GiB
    assert value_of(run(root, rootfs, a, "/bin/e2e_claim_quota", "alloc", str(2 * GiB)),
                  "alloc") == CUDA_ERROR_OUT_OF_MEMORY  # fmt: skip

    before = node_memory_used(root / "data")
    # The test's own directory for the holder's markers: the claim's mount is its accounting
    # file alone, which the tenant cannot add files beside.
    signal = root / "signal"
    signal.mkdir()
    holder = subprocess.Popen(
        podman(root, rootfs, a, "/bin/e2e_claim_quota", "hold", str(700 * MiB), "/signal",
               volumes=(f"{signal}:/signal",)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_held(holder, signal)
        # The holder's memory is on the node's simulated GPU, as the plugin's NVML sees it (its
        # own state and every claim's, observed) ...
        assert node_memory_used(root / "data") >= before + 700 * MiB
        # ... its claim's other container is refused past the claim's quota, ...
        assert value_of(run(root, rootfs, a, "/bin/e2e_claim_quota", "alloc", str(700 * MiB)),
                      "alloc") == CUDA_ERROR_OUT_OF_MEMORY  # fmt: skip
        # ... and the other claim has its own.
        assert value_of(run(root, rootfs, b, "/bin/e2e_claim_quota", "alloc", str(700 * MiB)),
                      "alloc") == 0  # fmt: skip
    finally:
        (signal / "release").touch()
        holder.wait(60)
    assert holder.returncode == 0, holder.stderr.read()  # type: ignore[union-attr]
    # The holder's memory went back to the simulated GPU when it exited.
    assert node_memory_used(root / "data") <= before


def test_limits_carry_the_context_size_and_the_first_process_does_not_measure(
    world: tuple[FakeApiServer, SimPlugin, KubeletStandin, Path], rootfs: Path
) -> None:
    """The plugin learns what a context takes on the simulated L4 (a helper process creates one
    and reads NVML) and writes it into the limits file (VGPU_CONTEXT_SIZE_<i>), kept in its data
    dir for the next claims; a fresh claim's first process charges it without loading NVML."""
    server, plugin, kubelet, root = world
    wait_learned(root)  # at start, in the background: a prepare waits for it only so long
    a = prepare(server, kubelet, "a", "2Gi")
    [limits] = (root / "data" / "claims").glob("*/limits")
    values = parse_limits_file(limits.read_text())
    context = int(values["VGPU_CONTEXT_SIZE_0"])
    assert context == CONTEXT_MEMORY, limits.read_text()  # the simulator's default
    cache = json.loads((root / "data" / "context-sizes.json").read_text())
    assert list(cache.values()) == [context], cache
    info = run(root, rootfs, a, "/bin/e2e_claim_quota", "info")
    assert value_of(info, "nvml") == 0, info  # nothing in the process loaded NVML
    assert value_of(info, "free") == 2 * GiB - context, info  # its context is charged, that size
    assert value_of(run(root, rootfs, a, "/bin/e2e_claim_quota", "info"), "nvml") == 0
    # a second claim's limits come from the learned size: no second helper
    prepare(server, kubelet, "b", "2Gi")
    assert plugin.output().count("learned by a helper process") == 1, plugin.output()


METRICS_PORT = free_port()

# Inside claim a's container: a GPU process of a's own, then three attacks on a's simulator state,
# each announced in /signal/<phase> and held until the test says /signal/go-<phase>.
ATTACK = r"""
set -u
wait_for() { n=0; while ! "$@"; do n=$((n + 1)); [ "$n" -lt 900 ] || exit 9; sleep 0.1; done; }
/bin/e2e_claim_quota hold 104857600 /signal/a &
wait_for [ -e /signal/a/held ]
for f in /run/vgpu-sim/state-v1-*; do case $f in *.pids) ;; *) F=$f ;; esac; done
step() { : > "/signal/$1"; wait_for [ -e "/signal/go-$1" ]; }
/bin/sim_die_locked node stop > /signal/locked-state &
/bin/sim_die_locked sched stop > /signal/locked-sched &
wait_for [ -s /signal/locked-state ]
wait_for [ -s /signal/locked-sched ]
step stopped
cat /bin/sh 1<> "$F"
step garbage
: > "$F"
step truncated
"""
# (every wait is bounded: the script, and with it the container's PID 1 and the stopped lock
# holders, ends within 90 s of a step the test never confirms)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as r:
        assert r.status == 200
        return str(r.read().decode())


@pytest.mark.parametrize(
    "world", [("--metrics-address", f"127.0.0.1:{METRICS_PORT}")], indirect=True
)
def test_a_tenant_wrecking_its_simulated_gpu_harms_no_other_claim_nor_the_plugin(
    world: tuple[FakeApiServer, SimPlugin, KubeletStandin, Path], rootfs: Path
) -> None:
    """Claim a's container stops processes holding the simulator's locks in its state, fills
    its state file with garbage, then truncates it, while claim b's container holds GPU memory.
    After each: b's process is still running, b's next container allocates and launches, the
    plugin (with --metrics-address: the exporter and the watchdog read NVML) is alive and its
    metrics answer, and the plugin's NVML still lists b's memory. With one node-wide state
    (before per-claim states), the stopped holder hung b and the plugin and the truncation
    killed both with SIGBUS."""
    server, plugin, kubelet, root = world
    a = prepare(server, kubelet, "a", "2Gi")
    b = prepare(server, kubelet, "b", "2Gi")
    sig = root / "signal"
    (sig / "a").mkdir(parents=True)
    (sig / "b").mkdir()
    assert "vgpu" in scrape(METRICS_PORT)
    victim = subprocess.Popen(
        podman(root, rootfs, b, "/bin/e2e_claim_quota", "hold", str(700 * MiB), "/signal/b",
               volumes=(f"{sig}:/signal",)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    attacker = None
    try:
        wait_held(victim, sig / "b")
        attacker = subprocess.Popen(
            podman(root, rootfs, a, "/bin/sh", "-c", ATTACK, volumes=(f"{sig}:/signal",)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for phase in ("stopped", "garbage", "truncated"):
            deadline = time.monotonic() + 60
            while not (sig / phase).exists():
                assert attacker.poll() is None, attacker.stderr.read()  # type: ignore[union-attr]
                if time.monotonic() > deadline:
                    attacker.kill()
                    _, err = attacker.communicate(timeout=30)
                    raise AssertionError(f"the attacker never got to {phase}: {err[-6000:]}")
                time.sleep(0.1)
            # a few of the exporter's refreshes (every 0.8 s while scraped) before any new
            # process opens a state (one would grow a truncated file back)
            for _ in range(3):
                time.sleep(1)
                died = plugin.proc.poll()
                assert died is None, f"{phase}: the plugin died ({died})\n{plugin.output()}"
                t0 = time.monotonic()
                assert scrape(METRICS_PORT), phase
                assert time.monotonic() - t0 < 10, phase
            assert victim.poll() is None, f"{phase}: b's GPU process died: {victim.returncode}"
            assert node_memory_used(root / "data") >= 700 * MiB, phase
            out = run(root, rootfs, b, "/bin/e2e_claim_quota", "alloc", str(100 * MiB))
            assert value_of(out, "alloc") == 0, f"{phase}: {out}"
            (sig / f"go-{phase}").touch()
        attacker.wait(60)
    finally:
        (sig / "b" / "release").touch()
        victim.wait(60)
        # the attacker's script runs to its end, and its container's PID 1 with it (which
        # takes the stopped lock holders along)
        for phase in ("stopped", "garbage", "truncated"):
            (sig / f"go-{phase}").touch()
        if attacker is not None:
            try:
                attacker.wait(60)
            except subprocess.TimeoutExpired:
                attacker.kill()
                attacker.wait(30)
    assert victim.returncode == 0, victim.stderr.read()  # type: ignore[union-attr]
    assert plugin.proc.poll() is None, plugin.output()
    assert scrape(METRICS_PORT)

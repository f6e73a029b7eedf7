"""The kubelet plugin (`vgpu-kubelet-plugin`) as a real process on the simulated GPU against the
fake API server: the simulated devices it finds, starting and stopping it, waiting for the
slices it publishes, and checking its API calls against deploy/base/rbac.yaml."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharing.paths import ArtefactMissingError, sim_lib_dir
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer, RecordedRequest, free_port

NODE = "node-a"
DRIVER = "vgpu.sharing.dev"
REPO = Path(__file__).resolve().parents[2]
PLUGIN = Path(sys.executable).parent / "vgpu-kubelet-plugin"


def _sim_nvml_works() -> str | None:
    """None if pynvml can initialise the simulated NVML in a fresh process, else why not."""
    try:
        lib = sim_lib_dir()
    except ArtefactMissingError as e:
        return str(e)
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib))
    probe = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())"
    r = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    if r.returncode != 0:
        return f"simulated NVML not usable yet: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


@pytest.fixture(scope="module")
def sim_ready() -> None:
    why = _sim_nvml_works()
    if why is not None:
        pytest.skip(why)


def device(i: int, healthy: bool = True) -> dict[str, Any]:
    return {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-5e1f0000-0000-0000-0000-00000000000{i}",
        "memory": "80Gi",
        "sm_count": 132,
        "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0",
        "numa_node": i % 2,
        "compute_capability": "9.0",
        "healthy": healthy,
        "minor": i,
    }


def write_config(
    path: Path,
    devices: list[dict[str, Any]],
    driver_version: str = "550.54.15",
    cuda_version: str = "12.4",
) -> None:
    """The simulator's configuration (SIMGPU_CONFIG) with these devices, replaced atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {"devices": devices, "driver_version": driver_version, "cuda_version": cuda_version}
        )
    )
    tmp.replace(path)  # atomic: the simulator never reads half a file


class PluginProcess:
    def __init__(self, server: FakeApiServer, root: Path, *extra: str) -> None:
        self.root = root
        self.port = free_port()
        self.config = root / "simgpu.json"
        state = root / "simgpu-state"
        state.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KUBECONFIG")}
        env.update(
            LD_LIBRARY_PATH=str(sim_lib_dir()),
            SIMGPU_CONFIG=str(self.config),
            SIMGPU_STATE=str(state),
            NODE_NAME=NODE,
            KUBECONFIG=str(server.kubeconfig_path(root)),
            CDI_ROOT=str(root / "cdi"),
            KUBELET_REGISTRAR_DIRECTORY_PATH=str(root / "reg"),
            KUBELET_PLUGINS_DIRECTORY_PATH=str(root / "plugins"),
            DATA_DIR=str(root / "data"),
            REDISCOVER_INTERVAL="300ms",
            HEALTHCHECK_PORT=str(self.port),
        )
        self.env = env
        self.log = (root / "plugin.log").open("w+")
        self.proc = subprocess.Popen(
            [str(PLUGIN), *extra], env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=root
        )

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.root / "plugin.log").read_text()

    def healthz(self) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vgpu-e2e-", dir="/tmp"))  # short: unix socket paths
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as s:
        s.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield s


def devices_of(server: FakeApiServer) -> dict[str, dict[str, Any]]:
    return {
        d["name"]: d
        for s in server.objects("ResourceSlice")
        for d in s["spec"].get("devices") or []
    }


def wait_names(
    server: FakeApiServer, proc: PluginProcess, names: list[str], timeout: float = 30
) -> None:
    deadline = time.monotonic() + timeout
    while sorted(devices_of(server)) != sorted(names):
        if proc.proc.poll() is not None:
            pytest.fail(f"plugin exited with {proc.proc.returncode}:\n{proc.output()}")
        if time.monotonic() > deadline:
            pytest.fail(f"devices {sorted(devices_of(server))}, wanted {names}:\n{proc.output()}")
        time.sleep(0.1)


def _split(r: RecordedRequest) -> tuple[str, list[str]]:
    """(API group, path parts after the version and any namespaces/<ns>)."""
    parts = r.path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if len(rest) > 2 and rest[0] == "namespaces":
        rest = rest[2:]
    return group, rest


def rbac_verb(r: RecordedRequest) -> str:
    named = len(_split(r)[1]) >= 2
    if r.method == "GET":
        if r.query.get("watch", ["false"])[0] in ("true", "1"):
            return "watch"
        return "get" if named else "list"
    if r.method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}[r.method]


def resource_of(r: RecordedRequest) -> tuple[str, str]:
    group, rest = _split(r)
    return group, "/".join(rest[0:3:2])  # resourceclaims/status for a subresource


# Non-resource URLs every authenticated user may GET (ClusterRole system:public-info-viewer).
PUBLIC_PATHS = ("/version", "/version/")


def assert_within_rbac(server: FakeApiServer) -> None:
    docs = list(yaml.safe_load_all((REPO / "deploy" / "base" / "rbac.yaml").read_text()))
    [role] = [d for d in docs if d["kind"] == "ClusterRole"]
    allowed = {
        (g, res, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for res in rule["resources"]
        for v in rule["verbs"]
    }
    used = {(*resource_of(r), rbac_verb(r)) for r in server.requests if r.path not in PUBLIC_PATHS}
    assert used, "the plugin made no API calls"
    assert used <= allowed, f"calls outside deploy/base/rbac.yaml: {sorted(used - allowed)}"


def probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


@dataclass
class ClaimWorld:
    """The real plugin with a watchdog, one prepared claim and one allocated (claim_world)."""

    plugin: PluginProcess
    kubelet: KubeletStandin
    claims: list[dict[str, Any]]
    uids: list[str]
    url: str
    env: dict[str, str]  # a GPU process of claims[0], on the plugin's simulated GPU

    def alive(self, why: str = "") -> None:
        """Fails at once, with the plugin's log, if it died (`why`: what else to say)."""
        p = self.plugin
        assert p.proc.poll() is None, (
            f"plugin died (exit {p.proc.returncode}{why}): {p.output()[-3000:]}"
        )

    def wait_for_line(self, pid: int) -> str:
        """The watchdog's line about process `pid`."""
        deadline = time.monotonic() + 60
        while True:
            self.alive()
            line = next((x for x in self.plugin.output().splitlines() if f"pid {pid} " in x), "")
            if line:
                return line
            assert time.monotonic() < deadline, f"no watchdog line about pid {pid}"
            time.sleep(0.5)


@contextmanager
def claim_world(
    server: FakeApiServer, root: Path, cg: Path | None = None, first: str = "attacker"
) -> Iterator[ClaimWorld]:
    """The real plugin (--metrics-address, --watchdog-enforce kill, as deploy/base runs it; in
    the memory cgroup `cg` if given) with claim `first` prepared and claim "later" allocated; at
    the end "later" is prepared and both unprepared (the plugin still serves every tenant)."""
    write_config(root / "simgpu.json", [device(0)])
    mport = free_port()
    url = f"http://127.0.0.1:{mport}"
    p = PluginProcess(
        server, root, "--metrics-address", f"127.0.0.1:{mport}", "--watchdog-enforce", "kill"
    )
    if cg is not None:
        (cg / "cgroup.procs").write_text(str(p.proc.pid))
    try:
        wait_names(server, p, ["gpu-0"])
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        share = {"consumedCapacity": {"memory": "1Gi", "cores": "30"}}
        claims = [
            server.put(
                allocated_claim(n, namespace="team", results=[result("gpu", "gpu-0") | share])
            )
            for n in (first, "later")
        ]
        uids = [c["metadata"]["uid"] for c in claims]
        assert kubelet.prepare([claim_id(claims[0])])[uids[0]].error == ""
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env.update(
            LD_LIBRARY_PATH=str(p.env["LD_LIBRARY_PATH"]),
            SIMGPU_CONFIG=str(p.config),
            SIMGPU_STATE=str(p.env["SIMGPU_STATE"]),
            # the claim it belongs to
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(
                root / "data" / "claims" / uids[0] / "shared" / "accounting"
            ),
        )
        w = ClaimWorld(p, kubelet, claims, uids, url, env)
        yield w
        # prepare and unprepare go on for every tenant
        assert kubelet.prepare([claim_id(claims[1])])[uids[1]].error == ""
        assert all(e == "" for e in kubelet.unprepare([claim_id(c) for c in claims]).values())
        kubelet.close()
    finally:
        code = p.terminate()
    assert code == 0, p.output()

"""End to end: the `vgpu-kubelet-plugin` console script as a real process, on the simulated GPU
(libnvidia-ml.so.1 from shim/sim through LD_LIBRARY_PATH), against the fake API server.

Checks the published slices (both modes, >128 devices), health changes through the simulator's
config, a prepare through the real DRA socket (the kubelet stand-in), /healthz, SIGTERM with a
clean exit, --cleanup, and that the plugin's API calls stay within deploy/base/rbac.yaml.
"""

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
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharing.claimlayout import MODE_FILE
from sharing.paths import ArtefactMissingError, sim_lib_dir
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer, RecordedRequest, free_port, parse_quantity

NODE = "node-a"
DRIVER = "vgpu.sharing.dev"
REPO = Path(__file__).resolve().parents[2]
PLUGIN = Path(sys.executable).parent / "vgpu-kubelet-plugin"
GiB = 1024**3

pytestmark = pytest.mark.slow


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


def write_config(path: Path, devices: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"devices": devices, "driver_version": "550.54.15", "cuda_version": "12.4"})
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


def test_sharing_mode_end_to_end(sim_ready: None, server: FakeApiServer, root: Path) -> None:
    config = root / "simgpu.json"
    write_config(config, [device(0), device(1)])
    p = PluginProcess(server, root)
    try:
        wait_names(server, p, ["gpu-0", "gpu-1"])
        d0 = devices_of(server)["gpu-0"]
        assert d0["allowMultipleAllocations"] is True
        assert d0["attributes"]["uuid"] == {"string": device(0)["uuid"]}
        assert d0["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
        assert d0["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
        assert d0["attributes"]["driverVersion"] == {"version": "550.54.15"}
        assert d0["attributes"]["resource.kubernetes.io/pcieRoot"]["string"].startswith("pci")
        assert parse_quantity(d0["capacity"]["memory"]["value"]) == 80 * GiB
        assert d0["capacity"]["memory"]["requestPolicy"]["validRange"]["max"] == "80Gi"
        [s] = server.objects("ResourceSlice")
        assert s["metadata"]["ownerReferences"][0]["kind"] == "Node"

        # /healthz is live; a kubelet stand-in registers and prepares a 4Gi/30-cores share.
        code, body = p.healthz()
        assert code == 200 and body["grpc"] == {"registration": True, "dra": True}
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        claim = server.put(
            allocated_claim(
                "share",
                results=[
                    result("gpu", "gpu-1") | {"consumedCapacity": {"memory": "4Gi", "cores": "30"}}
                ],
            )
        )
        answer = kubelet.prepare([claim_id(claim)])[claim["metadata"]["uid"]]
        assert answer.error == "", answer.error
        assert [d.device_name for d in answer.devices] == ["gpu-1"]
        assert list((root / "cdi").glob(f"*{claim['metadata']['uid']}*.json"))
        # With the API server gone, the sockets keep serving: a repeated prepare of a prepared
        # claim answers from the checkpoint, and /healthz stays live.
        server.down()
        again = kubelet.prepare([claim_id(claim)])[claim["metadata"]["uid"]]
        assert again.error == "" and [d.device_name for d in again.devices] == ["gpu-1"]
        assert p.healthz()[0] == 200
        server.up()
        kubelet.close()
        assert p.healthz()[1]["registered"] is True

        # The simulator reports gpu-1 unhealthy: it is tainted; healthy again: the taint goes
        # (tests/driver/test_health_e2e.py follows the cause to the stream, metric and alert).
        gen = server.objects("ResourceSlice")[0]["spec"]["pool"]["generation"]
        write_config(config, [device(0), device(1, healthy=False)])
        server.wait_for(lambda s: bool(devices_of(s)["gpu-1"].get("taints")), 30, "a taint")
        assert server.objects("ResourceSlice")[0]["spec"]["pool"]["generation"] > gen
        write_config(config, [device(0), device(1)])
        server.wait_for(lambda s: not devices_of(s)["gpu-1"].get("taints"), 30, "no taint")
    finally:
        code = p.terminate()
    out = p.output()
    assert code == 0, out
    assert "received SIGTERM" in out
    assert not (root / "plugins" / DRIVER / "dra.sock").exists()
    assert not (root / "reg" / f"{DRIVER}-reg.sock").exists()
    assert sorted(devices_of(server)) == ["gpu-0", "gpu-1"]  # no --cleanup: slices stay
    assert_within_rbac(server)


def test_partition_mode_many_devices_and_cleanup(sim_ready: None, root: Path) -> None:
    with FakeApiServer(drop_consumable_capacity=True) as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        write_config(root / "simgpu.json", [device(0), device(1), device(2)])
        p = PluginProcess(server, root, "--partitions", "64", "--cleanup")
        try:
            names = [f"gpu-{i}-slice-{k}" for i in range(3) for k in range(64)]
            wait_names(server, p, names)
            slices = server.objects("ResourceSlice")
            assert sorted(len(s["spec"]["devices"]) for s in slices) == [64, 128]
            assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}
            d = devices_of(server)["gpu-2-slice-63"]
            assert parse_quantity(d["capacity"]["memory"]["value"]) == 80 * GiB // 64
            assert d["capacity"]["cores"] == {"value": "1"}
            assert p.output().count("drops allowMultipleAllocations/requestPolicy") == 1
        finally:
            code = p.terminate()
        assert code == 0, p.output()
        assert server.objects("ResourceSlice") == []  # --cleanup
        assert_within_rbac(server)


def test_sigterm_while_api_server_is_down(
    sim_ready: None, server: FakeApiServer, root: Path
) -> None:
    write_config(root / "simgpu.json", [device(0)])
    (root / "data").mkdir()
    (root / "data" / MODE_FILE).write_text("sharing\n")
    server.down()
    p = PluginProcess(server, root)
    try:
        deadline = time.monotonic() + 30
        while "retrying in" not in p.output():
            assert p.proc.poll() is None, p.output()
            assert time.monotonic() < deadline, p.output()
            time.sleep(0.1)
        # The sockets serve although the API server is away.
        assert (root / "plugins" / DRIVER / "dra.sock").exists()
    finally:
        code = p.terminate()
    assert code == 0, p.output()


def test_gpu_appearing_after_start_is_offered_and_prepared(
    sim_ready: None, server: FakeApiServer, root: Path
) -> None:
    config = root / "simgpu.json"
    write_config(config, [device(0)])
    p = PluginProcess(server, root)
    try:
        wait_names(server, p, ["gpu-0"])
        write_config(config, [device(0), device(1)])  # a GPU is added to the node
        wait_names(server, p, ["gpu-0", "gpu-1"])
        assert "GPU 1 (" in p.output() and "appeared; offering it" in p.output()
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        claim = server.put(
            allocated_claim(
                "late",
                results=[
                    result("gpu", "gpu-1") | {"consumedCapacity": {"memory": "2Gi", "cores": "10"}}
                ],
            )
        )
        answer = kubelet.prepare([claim_id(claim)])[claim["metadata"]["uid"]]
        kubelet.close()
        assert answer.error == "", answer.error
        assert [d.device_name for d in answer.devices] == ["gpu-1"]
    finally:
        code = p.terminate()
    assert code == 0, p.output()

"""End to end: the `vgpu-kubelet-plugin` console script as a real process, on the simulated GPU
(libnvidia-ml.so.1 from shim/sim through LD_LIBRARY_PATH), against the fake API server.

Checks the published slices (both modes, >128 devices), health changes through the simulator's
config, a prepare through the real DRA socket (the kubelet stand-in), /healthz, SIGTERM with a
clean exit, --cleanup, and that the plugin's API calls stay within deploy/base/rbac.yaml.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sharing.claimlayout import MODE_FILE
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer, parse_quantity
from tests.support.plugin_e2e import (
    DRIVER,
    NODE,
    PluginProcess,
    assert_within_rbac,
    device,
    devices_of,
    root,
    server,
    sim_ready,
    wait_names,
    write_config,
)

GiB = 1024**3

__all__ = ["root", "server", "sim_ready"]  # fixtures used by name

pytestmark = pytest.mark.slow


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

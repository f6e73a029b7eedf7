"""`vgpu-kubelet-plugin --metrics-address`: the exporter and the watchdog inside the plugin,
as a real process on the simulated GPU against the fake API server. A prepared claim appears
as a slice with its namespace and name, and the pod and container names a stand-in kubelet's
PodResources API gives; a process that bypasses the shim with the claim's
environment is counted, gets an Event on the claim, and is stopped (--watchdog-enforce kill)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sharing.paths import sim_lib_dir
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer, free_port
from tests.fakes.podresources import Held as PodHeld
from tests.fakes.podresources import PodResourcesStandin
from tests.support.observers import only, scrape, scrape_until, value
from tests.support.plugin_e2e import (
    DRIVER,
    PluginProcess,
    assert_within_rbac,
    device,
    probe,
    root,
    server,
    sim_ready,
    wait_names,
    write_config,
)
from tests.support.shim_ops import Held

__all__ = ["root", "server", "sim_ready"]  # fixtures used by name
GiB = 1 << 30
pytestmark = pytest.mark.slow


def wait_events(server: FakeApiServer, reason: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The Events with this reason, once there is at least one (Events are posted from threads)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in server.objects("Event") if e["reason"] == reason]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_plugin_serves_claims_and_reports_a_bypass(
    sim_ready: None, server: FakeApiServer, root: Path, build_c: Callable[..., Path]
) -> None:
    ops = build_c("shim_ops.c")
    write_config(root / "simgpu.json", [device(0), device(1)])
    mport = free_port()
    url = f"http://127.0.0.1:{mport}"
    share = {"consumedCapacity": {"memory": "1Gi", "cores": "30"}}
    doc = allocated_claim("share", namespace="team-a", results=[result("gpu", "gpu-1") | share])
    doc["status"]["reservedFor"] = [
        {"resource": "pods", "name": "trainer-0", "uid": "6f1c0e5e-0000-4000-8000-000000000001"}
    ]
    claim = server.put(doc)
    uid = claim["metadata"]["uid"]
    # the kubelet's PodResources API, beside its plugins directory: container `main` holds it
    (root / "pod-resources").mkdir()
    pod_resources = PodResourcesStandin(root / "pod-resources" / "kubelet.sock").start()
    pod_resources.put(
        PodHeld("team-a", "trainer-0", "main", "share", (f"k8s.{DRIVER}/claim={uid}",))
    )
    p = PluginProcess(
        server, root, "--metrics-address", f"127.0.0.1:{mport}", "--watchdog-enforce", "kill"
    )
    try:
        wait_names(server, p, ["gpu-0", "gpu-1"])
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        assert kubelet.prepare([claim_id(claim)])[uid].error == ""
        # the pod and container come from the kubelet's PodResources API, read in the background
        deadline = time.monotonic() + 30
        while True:
            s = scrape(url)
            names = {(x.labels["pod"], x.labels["container"])
                     for x in only(s, "vgpu_slice_memory_limit_bytes")}  # fmt: skip
            if names == {("trainer-0", "main")} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert names == {("trainer-0", "main")}
        assert pod_resources.lists >= 1
        [limit] = only(s, "vgpu_slice_memory_limit_bytes", claim_uid=uid)
        assert limit.value == GiB
        assert limit.labels["namespace"] == "team-a" and limit.labels["claim"] == "share"
        assert limit.labels["UUID"] == device(1)["uuid"] and limit.labels["gpu"] == "1"
        assert limit.labels["Hostname"] == "node-a" and limit.labels["hostname"] == "node-a"
        # dcgm-exporter's DRA labels, from the plugin's checkpoint of the prepared claim
        assert {k: v for k, v in limit.labels.items() if k.startswith("dra_")} == {
            "dra_claim_name": "share", "dra_claim_namespace": "team-a", "dra_driver_name": DRIVER,
            "dra_pool_name": "node-a", "dra_device_name": "gpu-1",
        }  # fmt: skip
        assert value(s, "vgpu_slice_compute_limit_ratio", claim_uid=uid) == pytest.approx(0.3)
        assert value(s, "vgpu_device_slices", gpu="1") == 1

        # A container process of the claim that does not load the shim: the claim's env (the
        # accounting file, as the host sees it here), GPU 1, 2 GiB straight from the driver.
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env.update(
            LD_LIBRARY_PATH=str(sim_lib_dir()),
            SIMGPU_CONFIG=str(root / "simgpu.json"),
            SIMGPU_STATE=str(root / "simgpu-state"),
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(
                root / "data" / "claims" / uid / "shared" / "accounting"
            ),
        )
        bypass = Held(ops, env, "init", "ctx:1", f"alloc:{2 * GiB}")
        assert bypass.proc.wait(30) == -signal.SIGTERM
        s = scrape_until(url, lambda s: value(s, "vgpu_slice_quota_violations_total",
                                              claim_uid=uid) == 1)  # fmt: skip
        assert value(s, "vgpu_slice_quota_violations_total", claim_uid=uid) == 1
        [ev] = wait_events(server, "QuotaExceeded")
        assert ev["metadata"]["namespace"] == "team-a"
        assert ev["involvedObject"]["kind"] == "ResourceClaim"
        assert ev["involvedObject"]["uid"] == uid
        assert f"pid {bypass.proc.pid}" in ev["message"]
        # it did not load the shim at all: said too, on the claim
        [noshim] = wait_events(server, "ShimNotLoaded")
        assert noshim["involvedObject"]["uid"] == uid
        assert f"pid {bypass.proc.pid}" in noshim["message"]

        # a GPU process of no claim on the shared GPU: an Event on the Node, and stopped
        stray_env = {k: v for k, v in env.items() if k != "CUDA_DEVICE_MEMORY_SHARED_CACHE"}
        stray = Held(ops, stray_env, "init", "ctx:1", f"alloc:{64 << 20}")
        assert stray.proc.wait(30) == -signal.SIGTERM
        [node_ev] = wait_events(server, "UnattributedGPUProcess")
        assert node_ev["involvedObject"]["kind"] == "Node"
        assert node_ev["involvedObject"]["name"] == "node-a"
        assert f"pid {stray.proc.pid}" in node_ev["message"]

        assert kubelet.unprepare([claim_id(claim)])[uid] == ""
        s = scrape_until(url, lambda s: not only(s, "vgpu_slice_memory_limit_bytes", claim_uid=uid))
        assert only(s, "vgpu_slice_memory_limit_bytes", claim_uid=uid) == []
        kubelet.close()
    finally:
        code = p.terminate()
        pod_resources.stop()
    assert code == 0, p.output()
    assert_within_rbac(server)


def test_a_claims_process_without_the_shim_is_reported_under_its_quota(
    sim_ready: None, server: FakeApiServer, root: Path, build_c: Callable[..., Path]
) -> None:
    """Nothing limits a process that never loaded the shim (a musl image, a static binary, a
    cleared LD_PRELOAD), even while it holds little: the watchdog says so before it grows, in
    an Event on the claim, a gauge, and the plugin's /readyz body; enforce none: not stopped."""
    ops = build_c("shim_ops.c")
    write_config(root / "simgpu.json", [device(0)])
    mport = free_port()
    url = f"http://127.0.0.1:{mport}"
    p = PluginProcess(server, root, "--metrics-address", f"127.0.0.1:{mport}")
    try:
        wait_names(server, p, ["gpu-0"])
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        share = {"consumedCapacity": {"memory": "4Gi", "cores": "50"}}
        doc = allocated_claim(
            "notebook", namespace="team-b", results=[result("gpu", "gpu-0") | share]
        )
        claim = server.put(doc)
        uid = claim["metadata"]["uid"]
        assert kubelet.prepare([claim_id(claim)])[uid].error == ""
        claim_dir = root / "data" / "claims" / uid
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env.update(
            LD_LIBRARY_PATH=str(sim_lib_dir()),
            SIMGPU_CONFIG=str(root / "simgpu.json"),
            SIMGPU_STATE=str(root / "simgpu-state"),
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(claim_dir / "shared" / "accounting"),
        )
        # a process of the claim without the shim, far under the quota (64 MiB of 4 GiB). (A
        # shimmed neighbour must be the plugin's shim with the claim's mounted limits file, as
        # only a container has them: tests/sharing/observe/test_watchdog_attacks_podman.py.)
        bare = Held(ops, env, "init", "ctx", f"alloc:{64 << 20}")
        try:
            s = scrape_until(url, lambda s: value(s, "vgpu_slice_processes_without_shim",
                                                  claim_uid=uid) == 1)  # fmt: skip
            assert value(s, "vgpu_slice_processes_without_shim", claim_uid=uid) == 1
            assert value(s, "vgpu_slice_quota_violations_total", claim_uid=uid) == 0
            [ev] = wait_events(server, "ShimNotLoaded")
            assert ev["involvedObject"]["kind"] == "ResourceClaim"
            assert ev["involvedObject"]["uid"] == uid
            assert f"pid {bare.proc.pid}" in ev["message"]
            assert "the shim is not loaded into it" in ev["message"], ev["message"]
            body = probe(p.port, "/readyz")[1]
            assert body["live"] is True  # reported, not a readiness failure
            assert body["claimsWithoutShim"] == [
                {"claim": "team-b/notebook", "claimUID": uid, "gpu": device(0)["uuid"],
                 "pid": bare.proc.pid, "reason": ev["message"].rsplit(": ", 1)[1]}
            ]  # fmt: skip
            assert bare.proc.poll() is None  # enforce none: reported, not stopped
        finally:
            bare.release()
        s = scrape_until(url, lambda s: value(s, "vgpu_slice_processes_without_shim",
                                              claim_uid=uid) == 0)  # fmt: skip
        assert value(s, "vgpu_slice_processes_without_shim", claim_uid=uid) == 0
        assert probe(p.port, "/readyz")[1]["claimsWithoutShim"] == []
        assert len(wait_events(server, "ShimNotLoaded")) == 1  # one Event per process
        assert kubelet.unprepare([claim_id(claim)])[uid] == ""
        kubelet.close()
    finally:
        code = p.terminate()
    assert code == 0, p.output()
    assert p.output().count("process without the shim") == 1, p.output()


def test_without_the_watchdog_metrics_stay_and_no_process_is_judged(
    sim_ready: None, server: FakeApiServer, root: Path, build_c: Callable[..., Path]
) -> None:
    """--watchdog=false (components/no-watchdog, the sim overlay): the same bypass as above is
    neither counted, nor reported, nor stopped, while the claim's and the GPU's metrics stay."""
    ops = build_c("shim_ops.c")
    write_config(root / "simgpu.json", [device(0)])
    mport = free_port()
    url = f"http://127.0.0.1:{mport}"
    p = PluginProcess(server, root, "--metrics-address", f"127.0.0.1:{mport}", "--watchdog=false")
    bypass = None
    try:
        wait_names(server, p, ["gpu-0"])
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        share = {"consumedCapacity": {"memory": "1Gi", "cores": "30"}}
        claim = server.put(allocated_claim("share", results=[result("gpu", "gpu-0") | share]))
        uid = claim["metadata"]["uid"]
        assert kubelet.prepare([claim_id(claim)])[uid].error == ""
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env.update(
            LD_LIBRARY_PATH=str(sim_lib_dir()),
            SIMGPU_CONFIG=str(root / "simgpu.json"),
            SIMGPU_STATE=str(root / "simgpu-state"),
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(
                root / "data" / "claims" / uid / "shared" / "accounting"
            ),
        )
        bypass = Held(ops, env, "init", "ctx:0", f"alloc:{2 * GiB}")
        # NVML has seen the 2 GiB (the reading the watchdog would judge), and one more pass.
        scrape_until(url, lambda s: value(s, "vgpu_device_memory_used_bytes", gpu="0") >= 2 * GiB)
        time.sleep(1.5)
        s = scrape(url)
        assert value(s, "vgpu_slice_memory_limit_bytes", claim_uid=uid) == GiB
        assert value(s, "vgpu_slice_quota_violations_total", claim_uid=uid) == 0
        assert bypass.proc.poll() is None
        assert wait_events(server, "QuotaExceeded", timeout=0) == []
        assert wait_events(server, "ShimNotLoaded", timeout=0) == []
        assert probe(p.port, "/readyz")[1]["claimsWithoutShim"] is None
        bypass.release()
        bypass = None
        assert kubelet.unprepare([claim_id(claim)])[uid] == ""
        kubelet.close()
    finally:
        if bypass is not None:
            bypass.kill()
        code = p.terminate()
    assert code == 0, p.output()

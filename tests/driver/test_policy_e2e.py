"""The real `vgpu-kubelet-plugin` process with `--policy` on the simulated GPU, against the fake
API server: the policy mounted as a ConfigMap volume is (a `..data` symlink swapped on update),
a valid edit republished within 10 s, an invalid edit logged and ignored, an invalid file at
start-up exit 2; and the health server answering before the API server does."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer, parse_quantity
from tests.support.plugin_e2e import (
    DRIVER,
    PLUGIN,
    PluginProcess,
    device,
    devices_of,
    probe,
    root,  # noqa: F401 - fixture
    server,  # noqa: F401 - fixture
    sim_ready,  # noqa: F401 - fixture
    wait_names,
    write_config,
)

pytestmark = pytest.mark.slow
GiB = 1024**3
REPUBLISH_WITHIN = 10.0  # seconds, the promise


def policy(**default: Any) -> str:
    return yaml.safe_dump(
        {"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "SharingPolicy", "default": default}
    )


class ConfigMapDir:
    """A directory laid out as the kubelet lays out a ConfigMap volume, updated the same way."""

    def __init__(self, path: Path, key: str = "policy.yaml") -> None:
        self.path = path
        self.key = key
        self.n = 0
        path.mkdir()
        (path / key).symlink_to(f"..data/{key}")

    @property
    def file(self) -> Path:
        return self.path / self.key

    def update(self, text: str) -> None:
        self.n += 1
        stamp = self.path / f"..2026_11_23_{self.n:02d}"
        stamp.mkdir()
        (stamp / self.key).write_text(text)
        tmp = self.path / "..data_tmp"
        tmp.symlink_to(stamp.name)
        os.replace(tmp, self.path / "..data")  # the atomic swap


def sharers(api: FakeApiServer) -> str | None:
    d = devices_of(api).get("gpu-0")
    return None if d is None else str(d["capacity"]["sharers"]["value"])


def wait_until(pred: Any, p: PluginProcess, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not pred():
        if p.proc.poll() is not None:
            pytest.fail(f"plugin exited with {p.proc.returncode}:\n{p.output()}")
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what} not within {timeout}s:\n{p.output()}")
        time.sleep(0.1)
    return time.monotonic() - start


def test_policy_hot_reload_through_a_configmap_symlink_swap(
    sim_ready: None,  # noqa: F811
    server: FakeApiServer,  # noqa: F811
    root: Path,  # noqa: F811
) -> None:
    write_config(root / "simgpu.json", [device(0)])
    cm = ConfigMapDir(root / "policy")
    cm.update(policy(reservedMemory="2Gi", maxSharers=8))
    p = PluginProcess(server, root, "--policy", str(cm.file))
    try:
        wait_names(server, p, ["gpu-0"])
        cap = devices_of(server)["gpu-0"]["capacity"]
        assert parse_quantity(cap["memory"]["value"]) == 78 * GiB
        assert sharers(server) == "8"

        cm.update(policy(reservedMemory="2Gi", maxSharers=4))
        wait_until(lambda: sharers(server) == "4", p, REPUBLISH_WITHIN, "republish")
        assert "applied" in p.output()

        # An invalid edit: one error line, the last good policy stays.
        cm.update(policy(maxSharers=0))
        wait_until(lambda: "keeping the last good one" in p.output(), p, 10, "the error line")
        [line] = [x for x in p.output().splitlines() if "keeping the last good one" in x]
        assert "default.maxSharers: 0 invalid; allowed: an integer 1..1024" in line
        gen = server.objects("ResourceSlice")[0]["spec"]["pool"]["generation"]
        time.sleep(3)  # longer than a watcher interval: nothing is republished
        assert sharers(server) == "4"
        assert server.objects("ResourceSlice")[0]["spec"]["pool"]["generation"] == gen

        # Fixed again: applied.
        cm.update(policy(maxSharers=2))
        wait_until(lambda: sharers(server) == "2", p, REPUBLISH_WITHIN, "republish")
        assert parse_quantity(devices_of(server)["gpu-0"]["capacity"]["memory"]["value"]) == (
            80 * GiB
        )
    finally:
        code = p.terminate()
    assert code == 0, p.output()


def test_invalid_policy_at_startup_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "policy.yaml"
    bad.write_text(policy(computePolicy="off"))
    r = subprocess.run(
        [str(PLUGIN), "--node-name", "node-a", "--policy", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"vgpu-kubelet-plugin: error: --policy: {bad}: default.computePolicy: 'off' invalid; "
        "allowed: hard, elastic"
    )


def test_health_is_up_before_the_api_server_and_readiness_means_published(
    sim_ready: None,  # noqa: F811
    server: FakeApiServer,  # noqa: F811
    root: Path,  # noqa: F811
) -> None:
    write_config(root / "simgpu.json", [device(0)])
    server.down()  # the API server is unreachable from the start (auto mode must probe it)
    p = PluginProcess(server, root)
    try:
        wait_until(lambda: probe(p.port, "/healthz")[0] == 200, p, 30, "/healthz")
        code, body = probe(p.port, "/healthz")
        assert body["reason"] == "starting"
        assert probe(p.port, "/readyz")[0] == 503
        wait_until(lambda: "retrying in" in p.output(), p, 30, "an API retry")
        assert probe(p.port, "/healthz")[0] == 200  # still live while waiting

        server.up()
        wait_names(server, p, ["gpu-0"])
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        wait_until(lambda: probe(p.port, "/readyz")[0] == 200, p, 30, "/readyz")
        assert probe(p.port, "/readyz")[1] == {
            "live": True,
            "mode": "sharing",
            "registered": True,
            "slicesPublished": True,
            "claimsWithoutShim": None,  # no --metrics-address: no watchdog
        }
        kubelet.close()
    finally:
        code = p.terminate()
    assert code == 0, p.output()


def test_prepare_through_the_plugin_refuses_a_forbidden_compute_policy(
    sim_ready: None,  # noqa: F811
    server: FakeApiServer,  # noqa: F811
    root: Path,  # noqa: F811
) -> None:
    """The policy reaches the kubelet side of the running plugin: with allowedComputePolicies
    [], a claim choosing hard fails prepare (its error, for the pod's events); a claim that does
    not choose runs with the admin's default."""
    write_config(root / "simgpu.json", [device(0)])
    (root / "policy.yaml").write_text(policy(computePolicy="elastic", allowedComputePolicies=[]))
    p = PluginProcess(server, root, "--policy", str(root / "policy.yaml"))
    try:
        wait_names(server, p, ["gpu-0"])
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        share = result("gpu", "gpu-0") | {"consumedCapacity": {"memory": "4Gi", "cores": "20"}}
        choosing = {
            "source": "FromClaim",
            "requests": ["gpu"],
            "opaque": {
                "driver": DRIVER,
                "parameters": {
                    "apiVersion": "vgpu.sharing.dev/v1alpha1",
                    "kind": "VgpuConfig",
                    "computePolicy": "hard",
                },
            },
        }
        bad = server.put(allocated_claim("bad", results=[share], configs=[choosing]))
        good = server.put(allocated_claim("good", results=[share]))
        out = kubelet.prepare([claim_id(bad), claim_id(good)])
        kubelet.close()
        assert "computePolicy 'hard' is not allowed by the node's sharing policy" in (
            out[bad["metadata"]["uid"]].error
        )
        assert out[good["metadata"]["uid"]].error == ""
        spec = (root / "cdi" / f"k8s.{DRIVER}-claim_{good['metadata']['uid']}.json").read_text()
        assert "VGPU_COMPUTE_POLICY=elastic" in spec
    finally:
        code = p.terminate()
    assert code == 0, p.output()


UNCAPPED = {
    "source": "FromClaim",
    "requests": ["gpu"],
    "opaque": {
        "driver": DRIVER,
        "parameters": {
            "apiVersion": "vgpu.sharing.dev/v1alpha1",
            "kind": "VgpuConfig",
            "computePolicy": "off",
            "priority": -100,
        },
    },
}


@pytest.mark.parametrize("which", ["shipped", "legacy"])
def test_the_plugin_refuses_a_claim_switching_its_own_cap_off(
    which: str,
    sim_ready: None,  # noqa: F811
    server: FakeApiServer,  # noqa: F811
    root: Path,  # noqa: F811
) -> None:
    """Issue 33 part 4 through the running plugin: allocated `cores: 10`, a claim whose own
    VgpuConfig says `computePolicy: off, priority: -100` ran uncapped under the shipped policy.
    With deploy/base/policy.yaml (the ConfigMap as shipped), and with an old policy saying
    `allowPolicyOverride: true` (read as [hard, elastic], one deprecation line in the log),
    prepare now fails naming what is allowed."""
    write_config(root / "simgpu.json", [device(0)])
    if which == "shipped":
        path = Path(__file__).resolve().parents[2] / "deploy" / "base" / "policy.yaml"
    else:
        path = root / "policy.yaml"
        path.write_text(policy(computePolicy="hard", allowPolicyOverride=True))
    p = PluginProcess(server, root, "--policy", str(path))
    try:
        wait_names(server, p, ["gpu-0"])
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        share = result("gpu", "gpu-0") | {"consumedCapacity": {"memory": "4Gi", "cores": "10"}}
        claim = server.put(allocated_claim("uncapped", results=[share], configs=[UNCAPPED]))
        out = kubelet.prepare([claim_id(claim)])
        kubelet.close()
        assert out[claim["metadata"]["uid"]].error == (
            "device gpu-0: config[0] (FromClaim): VgpuConfig computePolicy 'off' is not allowed "
            "by the node's sharing policy (allowedComputePolicies: [hard, elastic]); allowed: "
            "hard, elastic or leave computePolicy out"
        )
        deprecated = (
            "default.allowPolicyOverride: true is deprecated; read as allowedComputePolicies"
        )
        assert p.output().count(deprecated) == (1 if which == "legacy" else 0), p.output()
    finally:
        code = p.terminate()
    assert code == 0, p.output()


def test_a_policy_nested_100k_deep_at_startup_exits_2_with_one_line(tmp_path: Path) -> None:
    deep = tmp_path / "policy.yaml"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    r = subprocess.run(
        [str(PLUGIN), "--node-name", "node-a", "--policy", str(deep)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"vgpu-kubelet-plugin: error: --policy: {deep}: not valid YAML: nested too deeply; "
        "allowed: a SharingPolicy document (a few levels of mappings and lists)"
    )

"""Every manifest of deploy/examples/ in the mode the plugin chose, on the real cluster: the real
scheduler allocates its claim, the real kubelet has the plugin prepare it, containerd applies the
claim's CDI spec, and the pod prints the share it was given. The test compares what the pod saw
with the claim's allocation (consumed capacity, or the partition's capacity in the slice)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sharing.kubequantity import parse_bytes
from tests.cluster.kube import (
    REPO,
    ClaimRecorder,
    Cluster,
    example_files,
    unschedulable,
    visible_gib,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

MODES = ("sharing", "partition")
# The folders of deploy/examples this test leaves to another, and why: the examples here run
# under the policy the cluster has, and these need another one.
ELSEWHERE = {
    # a policy that allows bursting (the shipped one allows none), applied before its pod
    "burst": "tests/cluster/test_burst_example.py",
}
# The NIC of gpu-and-nic comes from another DRA driver (DeviceClass nic.example.com); no NIC
# driver runs on this cluster, so that claim cannot be allocated here.
NEEDS_A_NIC_DRIVER = "gpu-and-nic.yaml"
# Partition mode's whole GPU needs a policy that leaves a GPU unpartitioned (partitions: 1, the
# example's comment); the sim overlay's policy cuts every GPU in 4, so the claim cannot fit.
NEEDS_A_WHOLE_GPU_POLICY = "partition/whole-gpu.yaml"


def _pods(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "Pod"]


def _device_memory(cluster: Cluster) -> dict[str, int]:
    """Each published device's memory capacity, in bytes."""
    out = {}
    for s in cluster.slices():
        for d in s["spec"].get("devices", []):
            out[d["name"]] = parse_bytes(d["capacity"]["memory"]["value"])
    return out


def mode_of(example: Path) -> str:
    return example.parent.name


def _device_gib(cluster: Cluster, device: str) -> float:
    return round(_device_memory(cluster)[device] / 2**30, 2)


def _expected_gib(cluster: Cluster, claim: dict[str, Any]) -> list[float]:
    """The memory the claim's devices give, per device in allocation order, in GiB."""
    memory = _device_memory(cluster)
    out = []
    for r in claim["status"]["allocation"]["devices"]["results"]:
        consumed = r.get("consumedCapacity", {}).get("memory")
        b = parse_bytes(consumed) if consumed is not None else memory[r["device"]]
        out.append(round(b / 2**30, 2))
    return out


def _outputs(cluster: Cluster, name: str, containers: list[str], done: str) -> dict[str, str]:
    """Each container's log once every one printed `done` (or the pod ended)."""

    def ready() -> dict[str, str] | None:
        pod = cluster.pod(name)
        phase = pod.get("status", {}).get("phase")
        if phase not in ("Running", "Succeeded", "Failed"):
            return None
        logs = {c: cluster.logs(name, c) for c in containers}
        if phase != "Running" or all(done in log for log in logs.values()):
            return logs
        return None

    out: dict[str, str] = cluster.wait_until(f"{name}'s output", ready, timeout=300, every=2)
    return out


def test_every_example_folder_is_run_here_or_elsewhere() -> None:
    """A new folder of examples is not silently left out of the cluster's runs."""
    folders = {p.name for p in (REPO / "deploy" / "examples").iterdir() if p.is_dir()}
    assert folders <= set(MODES) | set(ELSEWHERE), folders
    for where in ELSEWHERE.values():
        assert (REPO / where).is_file(), where


@pytest.mark.parametrize(
    "example",
    [pytest.param(p, id=f"{m}/{p.name}") for m in MODES for p in example_files(m)],
)
def test_example_pod_prints_its_share(clean_default: Cluster, example: Path) -> None:
    cluster = clean_default
    mode = example.parent.name
    if mode != cluster.mode:
        pytest.skip(f"the plugin publishes in {cluster.mode} mode on Kubernetes {cluster.version}")
    with ClaimRecorder(cluster) as claims:
        cluster.apply(example)
        try:
            for spec in _pods(example):
                _check_pod(cluster, claims, example, spec)
        finally:
            cluster.delete(example)


def _check_pod(
    cluster: Cluster, claims: ClaimRecorder, example: Path, spec: dict[str, Any]
) -> None:
    name = spec["metadata"]["name"]
    if example.name == NEEDS_A_NIC_DRIVER or f"{mode_of(example)}/{example.name}" == (
        NEEDS_A_WHOLE_GPU_POLICY
    ):
        # What the real scheduler says about a claim no driver here can satisfy.
        verdict = cluster.wait_until(
            "the scheduler's verdict", lambda: unschedulable(cluster.pod(name)), timeout=120
        )
        assert "nic.example.com" in verdict or "cannot allocate" in verdict, verdict
        print(f"\n=== {mode_of(example)}/{example.name}: Pending, as expected here: {verdict}")
        return
    refused = example.name == "refused-past-quota.yaml"
    done = "then refused" if refused else "GiB visible"
    logs = _outputs(cluster, name, [c["name"] for c in spec["spec"]["containers"]], done)
    pod = cluster.pod(name)
    assert pod["status"]["phase"] in ("Running", "Succeeded"), (pod["status"], logs)
    claim = claims.claim_of(pod)
    expected = _expected_gib(cluster, claim)
    exclusive = example.name == "whole-gpu.yaml"
    if exclusive:
        # The whole GPU (docs/driver-kubelet.md, "exclusive"): all its memory, at least what
        # the slice offers to claims, and every core held so that no other claim fits.
        results = claim["status"]["allocation"]["devices"]["results"]
        if mode_of(example) == "sharing":
            assert [parse_bytes(r["consumedCapacity"]["cores"]) for r in results] == [100]
        expected = [_device_gib(cluster, r["device"]) for r in results]
    for container, log in logs.items():
        seen = visible_gib(log)
        assert sorted(seen) == list(range(len(expected))), (container, log, expected)
        got = [seen[i] for i in sorted(seen)]
        if exclusive:
            assert all(g >= e for g, e in zip(got, expected, strict=True)), (log, expected)
        else:
            assert got == expected, (container, log, claim)
    if refused:
        assert "then refused (CUDA_ERROR_OUT_OF_MEMORY)" in logs["cuda"], logs
    if example.name == "extended-resource.yaml":
        # No claim in the pod: the scheduler wrote one for the extended resource.
        assert "extendedResourceClaimStatus" in pod["status"], pod["status"]
    print(f"\n=== {example.parent.name}/{example.name}: {expected} GiB")
    for container, log in logs.items():
        print(f"[{name}/{container}] {log.strip()}")

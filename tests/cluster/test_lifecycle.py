"""The plugin and the kubelet restarted under prepared claims, on the real cluster.

- The plugin's pod deleted (the DaemonSet makes a new one) while a claim is prepared: the
  claim's pod keeps running, untouched, and a new pod's claim still prepares.
- The kubelet restarted: it wipes its node's ResourceSlices at start; the plugin registers again
  and the slices are published again.
- The plugin gone longer than the kubelet's wipe delay (30 s in 1.37's DRA manager): the kubelet
  deletes the node's slices; a claim's running pod is untouched; the plugin back, they are
  published again.
- The policy ConfigMap edited: the plugin republishes its slices with the new values (the
  kubelet swaps the mounted file on a pod resync), and a running claim keeps its allocation,
  its limits file and its pod.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import yaml

from sharing.kubequantity import parse_bytes
from tests.cluster.kube import (
    DATA_DIR,
    SCRIPT,
    Cluster,
    claim_pod,
    policy_text,
    require_sharing,
    set_policy,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

NS = "vgpu-sharing"


def _plugin_pods(cluster: Cluster) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = cluster.get("pods", "-n", NS)["items"]
    return [p for p in pods if p["metadata"]["name"].startswith("vgpu-kubelet-plugin-")]


def _ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


def test_plugin_restart_keeps_prepared_claims(clean_default: Cluster) -> None:
    cluster = clean_default
    require_sharing(cluster)
    cluster.apply(claim_pod("before-restart", 8, 20))
    cluster.wait_output("before-restart")
    old = _plugin_pods(cluster)
    assert len(old) == 1 and _ready(old[0])
    old_uid = old[0]["metadata"]["uid"]

    cluster.kubectl("delete", "pod", "-n", NS, old[0]["metadata"]["name"], "--wait=true",
                    "--timeout=120s", timeout=180)  # fmt: skip
    cluster.wait_until(
        "a new Ready plugin pod",
        lambda: [p for p in _plugin_pods(cluster) if p["metadata"]["uid"] != old_uid and _ready(p)],
        timeout=180,
    )
    pod = cluster.pod("before-restart")
    assert pod["status"]["phase"] == "Running"
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0

    cluster.apply(claim_pod("after-restart", 8, 20))
    seen = cluster.wait_output("after-restart")
    assert seen == {0: 8.0}


def test_kubelet_restart_wipes_and_republishes_the_slices(cluster: Cluster) -> None:
    before = {s["metadata"]["uid"] for s in cluster.slices()}
    assert before
    r = subprocess.run([str(SCRIPT), "restart-kubelet"], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    # The kubelet deletes its node's slices when it starts; the plugin publishes new ones.
    after = cluster.wait_until(
        "new slices",
        lambda: {s["metadata"]["uid"] for s in cluster.slices()} - before,
        timeout=180,
    )
    assert after and not ({s["metadata"]["uid"] for s in cluster.slices()} & before)
    node = cluster.get("node", cluster.get("nodes")["items"][0]["metadata"]["name"])
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready[0]["status"] == "True"


GONE_LABEL = "vgpu.sharing.dev/test-plugin-gone"


def test_plugin_gone_past_the_wipe_delay_then_back(clean_default: Cluster) -> None:
    cluster = clean_default
    require_sharing(cluster)
    cluster.apply(claim_pod("while-gone", 4, 10))
    cluster.wait_output("while-gone")
    before = {s["metadata"]["uid"] for s in cluster.slices()}
    assert before
    # The DaemonSet no longer selects the node: its pod goes and stays away.
    patch = {"spec": {"template": {"spec": {"nodeSelector": {GONE_LABEL: "true"}}}}}
    cluster.kubectl("patch", "daemonset", "-n", NS, "vgpu-kubelet-plugin", "-p", json.dumps(patch))
    try:
        cluster.wait_until("the plugin's pod gone", lambda: not _plugin_pods(cluster), timeout=120)
        # The kubelet wipes the slices once the plugin has been unregistered for its delay.
        cluster.wait_until("the slices wiped", lambda: not cluster.slices(), timeout=150, every=2)
        pod = cluster.pod("while-gone")
        assert pod["status"]["phase"] == "Running", pod["status"]
    finally:
        remove = [
            {
                "op": "remove",
                "path": "/spec/template/spec/nodeSelector/" + GONE_LABEL.replace("/", "~1"),
            }
        ]
        cluster.kubectl("patch", "daemonset", "-n", NS, "vgpu-kubelet-plugin", "--type=json",
                        "-p", json.dumps(remove))  # fmt: skip
    cluster.wait_until(
        "a Ready plugin pod", lambda: [p for p in _plugin_pods(cluster) if _ready(p)], timeout=180
    )
    after = cluster.wait_until(
        "the slices published again", lambda: {s["metadata"]["uid"] for s in cluster.slices()}
    )
    assert not after & before, (after, before)
    pod = cluster.pod("while-gone")
    assert pod["status"]["phase"] == "Running", pod["status"]
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    # A new claim prepares with the plugin back.
    cluster.apply(claim_pod("after-return", 4, 10))
    assert cluster.wait_output("after-return") == {0: 4.0}


def test_policy_edit_republishes_and_leaves_running_claims(clean_default: Cluster) -> None:
    cluster = clean_default
    require_sharing(cluster)
    cluster.apply(claim_pod("policy-victim", 8, 20))
    cluster.wait_output("policy-victim")
    claim = cluster.get("resourceclaim", "policy-victim", "-n", "default")
    limits = DATA_DIR / "claims" / claim["metadata"]["uid"] / "limits"
    limits_before = limits.read_bytes()
    original = policy_text(cluster)
    policy = yaml.safe_load(original)
    reserved = parse_bytes(policy["default"]["reservedMemory"])
    memory_before = cluster.published_memory("gpu-0")
    policy["default"]["reservedMemory"] = f"{(reserved >> 30) + 2}Gi"
    try:
        set_policy(cluster, yaml.safe_dump(policy))
        cluster.wait_until(
            "gpu-0's memory 2 GiB smaller in the slices",
            lambda: cluster.published_memory("gpu-0") == memory_before - (2 << 30),
            timeout=120,
            every=2,
        )
        pod = cluster.pod("policy-victim")
        assert pod["status"]["phase"] == "Running", pod["status"]
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
        now = cluster.get("resourceclaim", "policy-victim", "-n", "default")
        assert now["status"]["allocation"] == claim["status"]["allocation"]
        assert limits.read_bytes() == limits_before
    finally:
        set_policy(cluster, original)
    cluster.wait_until(
        "gpu-0's memory back",
        lambda: cluster.published_memory("gpu-0") == memory_before,
        timeout=120,
    )

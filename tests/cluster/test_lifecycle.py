"""The plugin and the kubelet restarted under prepared claims, on the real cluster.

- The plugin's pod deleted (the DaemonSet makes a new one) while a claim is prepared: the
  claim's pod keeps running, untouched, and a new pod's claim still prepares.
- The kubelet restarted: it wipes its node's ResourceSlices at start; the plugin registers again
  and the slices are published again.
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.cluster.kube import SCRIPT, Cluster, claim_pod, visible_gib

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


def _sharing(cluster: Cluster) -> None:
    if cluster.mode != "sharing":
        pytest.skip(f"the plugin publishes in {cluster.mode} mode on Kubernetes {cluster.version}")


def test_plugin_restart_keeps_prepared_claims(clean_default: Cluster) -> None:
    cluster = clean_default
    _sharing(cluster)
    cluster.apply(claim_pod("before-restart", 8, 20))
    cluster.wait_pod("before-restart", ("Running",))
    cluster.wait_until("output", lambda: visible_gib(cluster.logs("before-restart")))
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
    cluster.wait_pod("after-restart", ("Running",))
    seen = cluster.wait_until("output", lambda: visible_gib(cluster.logs("after-restart")))
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

"""Health on the real cluster: a simulated XID on GPU 0 (its device turned unhealthy in the
simulator's device file, which the plugin's NVML reads) taints GPU 0's devices in the
ResourceSlice, and the real kubelet shows the running pod's device Unhealthy in
`allocatedResourcesStatus` (the plugin's health stream); recovery removes the taint."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.kube import DATA_DIR, DRIVER, Cluster, claim_pod

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

SIM_CONFIG = DATA_DIR / "sim" / "config.json"


def _set_health(healthy: bool) -> None:
    """GPU 0 of the simulator's device file healthy or not, written atomically."""
    config = json.loads(SIM_CONFIG.read_text())
    devices = config["devices"] if isinstance(config, dict) else config
    devices[0]["healthy"] = healthy
    tmp = SIM_CONFIG.with_suffix(".test-tmp")
    tmp.write_text(json.dumps(config))
    os.chmod(tmp, 0o644)
    tmp.rename(SIM_CONFIG)


def _gpu0_taints(cluster: Cluster) -> list[dict[str, Any]]:
    out = []
    for s in cluster.slices():
        for d in s["spec"].get("devices", []):
            if d["name"] == "gpu-0" or d["name"].startswith("gpu-0-slice-"):
                out += d.get("taints", [])
    return out


def _device_health(cluster: Cluster, pod: str) -> list[str]:
    statuses = cluster.pod(pod)["status"].get("containerStatuses", [])
    return [
        r.get("health", "")
        for c in statuses
        for a in c.get("allocatedResourcesStatus", [])
        for r in a.get("resources", [])
    ]


def test_an_xid_taints_the_gpu_and_shows_in_the_pods_status(clean_default: Cluster) -> None:
    cluster = clean_default
    assert SIM_CONFIG.exists(), f"no simulator device file at {SIM_CONFIG}"
    memory = 4 if cluster.mode == "sharing" else None
    cluster.apply(claim_pod("xid-victim", memory, 10))
    cluster.wait_output("xid-victim")
    assert _gpu0_taints(cluster) == []
    # Before the XID the kubelet reports the device Healthy, or (1.34) nothing yet.
    assert set(_device_health(cluster, "xid-victim")) <= {"Healthy"}
    original = SIM_CONFIG.read_bytes()
    try:
        _set_health(False)
        taints = cluster.wait_until("a taint on GPU 0", lambda: _gpu0_taints(cluster), timeout=120)
        assert {t["key"] for t in taints} == {f"{DRIVER}/unhealthy"}, taints
        assert {t["effect"] for t in taints} == {"NoSchedule"}, taints
        assert {t.get("value") for t in taints} == {"xid-79"}, taints
        if cluster.version.startswith("1.34."):
            # Seen on 1.34.4 (ResourceHealthStatus on everywhere): the kubelet opens the
            # v1alpha1 health stream and the plugin reports GPU 0 unhealthy, but the pod's
            # allocatedResourcesStatus never shows the device. Not yet understood.
            pytest.xfail("1.34.4: no allocatedResourcesStatus in the pod (open finding)")
        cluster.wait_until(
            "the pod's device Unhealthy",
            lambda: "Unhealthy" in _device_health(cluster, "xid-victim"),
            timeout=120,
        )
        # The running pod is not evicted (NoSchedule): it keeps running.
        assert cluster.pod("xid-victim")["status"]["phase"] == "Running"
    finally:
        tmp = Path(f"{SIM_CONFIG}.test-restore")
        tmp.write_bytes(original)
        os.chmod(tmp, 0o644)
        tmp.rename(SIM_CONFIG)
    cluster.wait_until("GPU 0 untainted", lambda: not _gpu0_taints(cluster), timeout=180)

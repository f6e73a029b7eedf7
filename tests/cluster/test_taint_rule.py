"""An admin's DeviceTaintRule with NoExecute on GPU 0 evicts the pod whose claim uses it (the real
kube-controller-manager's device-taint eviction; docs/operations.md, "Unhealthy GPUs"); a pod on GPU 1 stays."""

from __future__ import annotations

import json

import pytest

from tests.cluster.kube import DRIVER, NODE, Cluster, claim_pod, require_sharing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

RULE = f"""
apiVersion: resource.k8s.io/v1
kind: DeviceTaintRule
metadata:
  name: drain-gpu-0
spec:
  deviceSelector:
    driver: {DRIVER}
    pool: {NODE}
    device: gpu-0
  taint:
    key: example.com/maintenance
    value: drain
    effect: NoExecute
"""


def test_a_noexecute_device_taint_rule_evicts_the_pod(clean_default: Cluster) -> None:
    cluster = clean_default
    if not cluster.version.startswith("1.37."):
        pytest.skip(f"DeviceTaintRule is resource.k8s.io/v1 from 1.37 (this is {cluster.version})")
    require_sharing(cluster)
    cluster.apply(claim_pod("on-gpu-0", 4, 10, gpu_index=0))
    cluster.apply(claim_pod("on-gpu-1", 4, 10, gpu_index=1))
    for name in ("on-gpu-0", "on-gpu-1"):
        cluster.wait_output(name)
    try:
        cluster.apply(RULE)

        def evicted() -> bool:
            # One read: a second `get` could come after the pod is gone and fail the test.
            r = cluster.kubectl("get", "pod", "on-gpu-0", "-o", "json", check=False)
            if r.returncode != 0:
                return "NotFound" in r.stderr  # deleted; another error: ask again
            pod = json.loads(r.stdout)
            return pod["status"].get("phase") in ("Failed", "Succeeded") or bool(
                pod["metadata"].get("deletionTimestamp")
            )

        cluster.wait_until("on-gpu-0 evicted", evicted, timeout=180)
        assert cluster.pod("on-gpu-1")["status"]["phase"] == "Running"
    finally:
        cluster.kubectl("delete", "devicetaintrule", "drain-gpu-0", "--ignore-not-found")

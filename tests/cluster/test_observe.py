"""What the plugin tells about a prepared claim, on the real cluster:

- the claim's device status (KEP-4817, `status.devices`), written by the plugin's server-side
  apply through the real API server's `resourceclaims/driver` authorisation, and removed again
  when the real kubelet has the claim unprepared;
- the device metadata files (KEP-5304) in the container, at the paths the protocol names for a
  claim the pod names and for one the real controller made from a template (its
  `resource.kubernetes.io/pod-claim-name` annotation);
- the metrics' slice series labelled with the pod and container names the real kubelet's
  PodResources API lists for the claim's CDI device (the `container` label has no other source).

One pod holds two claims of the driver: one by name, one from a template.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from sharing.kubequantity import parse_bytes
from tests.cluster.kube import DRIVER, Cluster, require_sharing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

NS = "vgpu-sharing"
POD = "observed-pod"
CONTAINER = "reader"
NAMED = "named-share"
METADATA_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
MANIFEST = f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {NAMED}, namespace: default}}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: {DRIVER}
          capacity: {{requests: {{memory: 6Gi, cores: "15"}}}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: tmpl-share, namespace: default}}
spec:
  spec:
    devices:
      requests:
        - name: second
          exactly:
            deviceClassName: {DRIVER}
            capacity: {{requests: {{memory: 2Gi, cores: "5"}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: {POD}, namespace: default}}
spec:
  securityContext: {{seccompProfile: {{type: RuntimeDefault}}}}
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  resourceClaims:
    - {{name: by-name, resourceClaimName: {NAMED}}}
    - {{name: from-template, resourceClaimTemplateName: tmpl-share}}
  containers:
    - name: {CONTAINER}
      image: python:3.12-slim
      command: ["sleep", "100000"]
      resources: {{claims: [{{name: by-name}}, {{name: from-template}}]}}
"""


def _claims(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """The pod's two claims by their name in the pod."""
    pod = cluster.pod(POD)
    out = {}
    # a template's claim is named in the status, a claim the pod names in the spec
    refs = pod["spec"]["resourceClaims"] + pod["status"].get("resourceClaimStatuses", [])
    for r in refs:
        if r.get("resourceClaimName"):
            out[r["name"]] = cluster.get("resourceclaim", r["resourceClaimName"], "-n", "default")
    assert set(out) == {"by-name", "from-template"}, pod["status"]
    return out


def _metadata(cluster: Cluster, path: str) -> list[dict[str, Any]]:
    """The JSON objects of a metadata file in the container (a stream, one per API version)."""
    text = cluster.kubectl("exec", POD, "-c", CONTAINER, "--", "cat", path).stdout
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = dec.raw_decode(text, i)
        out.append(obj)
    return out


def _metrics_url(cluster: Cluster) -> str:
    pods = cluster.get("pods", "-n", NS, "-l", "app.kubernetes.io/name=vgpu-kubelet-plugin")
    ips = [p["status"].get("podIP") for p in pods["items"] if p["status"].get("podIP")]
    assert len(ips) == 1, pods["items"]
    return f"http://{ips[0]}:9402/metrics"


def _slice_owners(url: str) -> dict[str, tuple[str, str]]:
    """claim name -> (pod, container) labels of vgpu_slice_memory_limit_bytes."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "vgpu_slice_memory_limit_bytes":
            for s in fam.samples:
                out[s.labels["claim"]] = (s.labels["pod"], s.labels["container"])
    return out


def test_claim_status_metadata_files_and_pod_labels(clean_default: Cluster) -> None:
    cluster = clean_default
    require_sharing(cluster)
    cluster.apply(MANIFEST)
    cluster.wait_pod(POD, ("Running",))
    claims = _claims(cluster)
    asked = {"by-name": (6 << 30, 15), "from-template": (2 << 30, 5)}

    # KEP-4817: one status entry per allocated device, keyed like the allocation, Ready.
    for name, claim in claims.items():
        result = claim["status"]["allocation"]["devices"]["results"][0]
        devices = cluster.wait_until(
            f"{name}'s status.devices",
            lambda n=claim["metadata"]["name"]: (
                cluster.get("resourceclaim", n, "-n", "default").get("status", {}).get("devices")
            ),
        )
        assert len(devices) == 1, devices
        d = devices[0]
        key = ("driver", "pool", "device", "shareID")
        assert {k: d.get(k) for k in key} == {k: result.get(k) for k in key}, (d, result)
        ready = [c for c in d["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", d
        memory, cores = asked[name]
        assert d["data"]["memoryLimitBytes"] == memory, d
        assert d["data"]["smLimitPercent"] == cores, d

    # KEP-5304: the files at the protocol's paths, newest API version first.
    uuids = {
        d["name"]: d["attributes"]["uuid"]["string"]
        for s in cluster.slices()
        for d in s["spec"]["devices"]
    }
    files = {
        "by-name": f"{METADATA_ROOT}/resourceclaims/{NAMED}/gpu/{DRIVER}-metadata.json",
        "from-template": (
            f"{METADATA_ROOT}/resourceclaimtemplates/from-template/second/{DRIVER}-metadata.json"
        ),
    }
    for name, path in files.items():
        claim = claims[name]
        result = claim["status"]["allocation"]["devices"]["results"][0]
        docs = _metadata(cluster, path)
        assert [d["apiVersion"] for d in docs] == [
            "metadata.resource.k8s.io/v1beta1",
            "metadata.resource.k8s.io/v1alpha1",
        ], docs
        for doc in docs:
            assert doc["kind"] == "DeviceMetadata"
            assert doc["metadata"]["uid"] == claim["metadata"]["uid"], doc["metadata"]
            assert doc["metadata"]["name"] == claim["metadata"]["name"], doc["metadata"]
            [request] = doc["requests"]
            assert request["name"] == result["request"], request
            [dev] = request["devices"]
            assert (dev["driver"], dev["pool"], dev["name"]) == (
                result["driver"],
                result["pool"],
                result["device"],
            ), dev
            attrs = dev["attributes"]
            assert attrs["uuid"]["string"] == uuids[result["device"]], attrs
            assert attrs["memoryLimit"]["int"] == asked[name][0], attrs
            assert attrs["smLimit"]["int"] == asked[name][1], attrs
        assert parse_bytes(result["consumedCapacity"]["memory"]) == asked[name][0]

    # The metrics: both slices carry the pod and the container the kubelet lists for them.
    url = _metrics_url(cluster)
    names = {claim["metadata"]["name"] for claim in claims.values()}
    owners = cluster.wait_until(
        "the slices' pod and container labels",
        lambda: (o := _slice_owners(url)) and all(o.get(n, ("", ""))[1] for n in names) and o,
        timeout=60,
        every=2,
    )
    for n in names:
        assert owners[n] == (POD, CONTAINER), owners

    # Unprepared when the pod goes: the plugin's status entries leave the named claim.
    cluster.kubectl("delete", "pod", POD, "--wait=true", "--timeout=120s", timeout=180)
    cluster.wait_until(
        "the named claim's status.devices removed",
        lambda: (
            not cluster.get("resourceclaim", NAMED, "-n", "default")
            .get("status", {})
            .get("devices")
        ),
        timeout=120,
    )

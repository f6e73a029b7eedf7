"""CEL selectors on the driver's attributes and a `matchAttribute` constraint across two requests,
decided by the real scheduler (sharing mode): the claim lands where the attributes say, and its
pod sees what it was given."""

from __future__ import annotations

from typing import Any

import pytest

from sharing.kubequantity import parse_bytes
from tests.cluster.kube import DRIVER, ClaimRecorder, Cluster, require_sharing, visible_gib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

PROGRAM = """
import ctypes as C
cu = C.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0, "cuInit failed"
n = C.c_int()
cu.cuDeviceGetCount(C.byref(n))
for i in range(n.value):
    dev, ctx, free, total = C.c_int(), C.c_void_p(), C.c_size_t(), C.c_size_t()
    cu.cuDeviceGet(C.byref(dev), i)
    cu.cuCtxCreate_v2(C.byref(ctx), 0, dev)
    cu.cuMemGetInfo_v2(C.byref(free), C.byref(total))
    print(f"GPU {i}: {total.value / 2**30:.2f} GiB visible, {free.value / 2**30:.2f} GiB free")
    cu.cuCtxDestroy_v2(ctx)
"""


def _manifest(name: str, requests: str, constraints: str = "") -> str:
    program = "\n".join("            " + line for line in PROGRAM.strip().splitlines())
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: default}}
spec:
  devices:
    requests:
{requests}
{constraints}
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  securityContext:
    seccompProfile: {{type: RuntimeDefault}}
  restartPolicy: Never
  resourceClaims:
    - {{name: gpu, resourceClaimName: {name}}}
  containers:
    - name: cuda
      image: python:3.12-slim
      command: ["python3", "-c"]
      args:
        - |
{program}
      resources:
        claims:
          - name: gpu
"""


def _request(name: str, memory: str, cel: str) -> str:
    return f"""      - name: {name}
        exactly:
          deviceClassName: {DRIVER}
          selectors:
            - cel:
                expression: '{cel}'
          capacity:
            requests: {{memory: {memory}, cores: "10"}}"""


def _slice_attrs(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {
        d["name"]: d["attributes"] for s in cluster.slices() for d in s["spec"].get("devices", [])
    }


def _run(cluster: Cluster, name: str, manifest: str) -> tuple[dict[str, Any], dict[int, float]]:
    with ClaimRecorder(cluster) as claims:
        cluster.apply(manifest)
        pod = cluster.wait_pod(name, ("Succeeded", "Failed"), timeout=300)
        log = cluster.logs(name)
        assert pod["status"]["phase"] == "Succeeded", log
        claim = claims.claim_of(pod)
    return claim, visible_gib(log)


def test_cel_selector_on_our_attributes_picks_the_gpu(clean_default: Cluster) -> None:
    cluster = clean_default
    require_sharing(cluster)
    attrs = _slice_attrs(cluster)
    uuid = attrs["gpu-1"]["uuid"]["string"]
    cel = (
        f'device.attributes["{DRIVER}"].uuid == "{uuid}" && '
        f'device.attributes["{DRIVER}"].architecture == "Hopper" && '
        f'device.attributes["{DRIVER}"].cudaComputeCapability.compareTo(semver("9.0.0")) >= 0'
    )
    claim, seen = _run(cluster, "cel-gpu1", _manifest("cel-gpu1", _request("gpu", "3Gi", cel)))
    results = claim["status"]["allocation"]["devices"]["results"]
    assert [r["device"] for r in results] == ["gpu-1"], results
    assert seen == {0: 3.0}


def test_match_attribute_puts_two_requests_on_one_gpu(clean_default: Cluster) -> None:
    cluster = clean_default
    require_sharing(cluster)
    any_gpu = f'device.attributes["{DRIVER}"].type == "gpu"'
    requests = _request("a", "2Gi", any_gpu) + "\n" + _request("b", "6Gi", any_gpu)
    constraints = f"""    constraints:
      - requests: ["a", "b"]
        matchAttribute: {DRIVER}/uuid"""
    claim, seen = _run(cluster, "same-gpu", _manifest("same-gpu", requests, constraints))
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 2 and results[0]["device"] == results[1]["device"], results
    assert results[0].get("shareID") != results[1].get("shareID"), results
    memory = sorted(parse_bytes(r["consumedCapacity"]["memory"]) for r in results)
    assert memory == [2 * 2**30, 6 * 2**30], results
    # Two shares of one GPU in one claim: the container sees that GPU once, with their sum.
    assert seen == {0: 8.0}, (results, seen)

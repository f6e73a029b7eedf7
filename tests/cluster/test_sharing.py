"""The real scheduler shares one simulated GPU (sharing mode: consumable capacity), and the real
kubelet has the plugin prepare and unprepare the claims.

- Pods whose claims all select GPU 0 get distinct share IDs with the capacity they asked for, the
  sum never above the device's capacity, and each pod sees its own share from inside.
- A claim that no longer fits stays Pending with the scheduler's reason, and schedules once a pod
  is deleted.
- Deleting a pod unprepares its claim: the claim's CDI spec and accounting file are gone.
"""

from __future__ import annotations

import pytest

from sharing.kubequantity import parse_bytes
from tests.cluster.kube import (
    CDI_ROOT,
    DATA_DIR,
    Cluster,
    claim_pod,
    require_sharing,
    unschedulable,
    visible_gib,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

MEMORY_GI = 30  # three of these do not fit in one 80 GB GPU; two do
CORES = 30


def test_pods_share_one_gpu_and_a_claim_that_does_not_fit_waits(clean_default: Cluster) -> None:
    cluster = clean_default
    require_sharing(cluster)
    names = ["share-a", "share-b", "share-c"]
    for n in names[:2]:
        cluster.apply(claim_pod(n, MEMORY_GI, CORES))
    for n in names[:2]:
        cluster.wait_output(n)

    claims = [cluster.get("resourceclaim", n, "-n", "default") for n in names[:2]]
    results = [c["status"]["allocation"]["devices"]["results"][0] for c in claims]
    assert {r["device"] for r in results} == {"gpu-0"}, results
    share_ids = [r.get("shareID") for r in results]
    assert all(share_ids) and len(set(share_ids)) == 2, results
    for r in results:
        assert parse_bytes(r["consumedCapacity"]["memory"]) == MEMORY_GI * 2**30, r
        assert parse_bytes(r["consumedCapacity"]["cores"]) == CORES, r
    for n in names[:2]:
        assert visible_gib(cluster.logs(n)) == {0: float(MEMORY_GI)}, cluster.logs(n)

    # The third does not fit beside the two: Pending, with the real scheduler's reason.
    cluster.apply(claim_pod(names[2], MEMORY_GI, CORES))
    reason = cluster.wait_until(
        "the scheduler's reason", lambda: unschedulable(cluster.pod(names[2]))
    )
    assert "cannot allocate all claims" in reason, reason
    assert cluster.pod(names[2])["status"]["phase"] == "Pending"
    claim_c = cluster.get("resourceclaim", names[2], "-n", "default")
    assert "allocation" not in claim_c.get("status", {}), claim_c

    # The sum of what is allocated on gpu-0 stays within its capacity.
    capacity = next(
        d["capacity"]
        for s in cluster.slices()
        for d in s["spec"]["devices"]
        if d["name"] == "gpu-0"
    )
    total = sum(parse_bytes(r["consumedCapacity"]["memory"]) for r in results)
    assert total <= parse_bytes(capacity["memory"]["value"])

    # Deleting a pod (and its claim) makes room: the third schedules and sees its share.
    cluster.delete(claim_pod(names[0], MEMORY_GI, CORES))
    cluster.wait_output(names[2])
    assert visible_gib(cluster.logs(names[2])) == {0: float(MEMORY_GI)}
    c = cluster.get("resourceclaim", names[2], "-n", "default")
    r = c["status"]["allocation"]["devices"]["results"][0]
    assert r["device"] == "gpu-0" and r.get("shareID") not in (None, share_ids[1]), r


def test_pod_deletion_unprepares_the_claim(clean_default: Cluster) -> None:
    cluster = clean_default
    require_sharing(cluster)
    name = "unprepare-me"
    cluster.apply(claim_pod(name, MEMORY_GI, CORES))
    cluster.wait_output(name)
    uid = cluster.get("resourceclaim", name, "-n", "default")["metadata"]["uid"]
    specs = [p for p in CDI_ROOT.glob("*.json") if uid in p.name]
    accounting = DATA_DIR / "claims" / uid / "shared" / "accounting"
    assert specs, sorted(p.name for p in CDI_ROOT.iterdir())
    assert accounting.exists()
    # The kubelet recorded the claim as prepared on its node (the claim's reservation).
    claim = cluster.get("resourceclaim", name, "-n", "default")
    assert [r["name"] for r in claim["status"]["reservedFor"]] == [name]

    cluster.kubectl("delete", "pod", name, "--wait=true", "--timeout=120s", timeout=180)
    cluster.wait_until(
        "the CDI spec and the claim directory removed",
        lambda: not any(p.exists() for p in specs) and not accounting.exists(),
        timeout=120,
    )
    assert not (DATA_DIR / "claims" / uid).exists()

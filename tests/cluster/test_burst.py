"""Bursting memory on the real cluster (docs/policy.md, "Memory that bursts and is given back"):
a pod whose claim asks for 2 GiB with a `memoryLimit` of 12 GiB borrows memory no claim was
allocated; then a new pod whose claim's request needs that memory is scheduled on the same GPU,
and the plugin takes it back in the new claim's prepare, before the new pod's container starts:
the borrower gets the notice (SIGWINCH), frees what it borrowed above its new grant and keeps
running, and the new pod allocates its whole request at once. The simulated GPU is the judge:
without the reclaim both pods would need more than the device holds, and the new pod's
allocation would fail.

The plugin runs with the sim-watchdog overlay (hostPID, as deploy/base on GPU nodes): to notice
and stop a borrower it must see the host's processes (a plugin in a PID namespace of its own sees
none of the tenants'). The policy allows bursting for the test (the built-in allows none) and is
restored after, as is the sim overlay.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml

from tests.cluster.kube import (
    PLUGIN_NS,
    Cluster,
    claim_pod,
    policy_text,
    require_sharing,
    rollout,
    set_policy,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

GiB = 1 << 30
GPU = 1  # gpu-1: the other tests' pods mostly use gpu-0
REQUEST_GI = 2
LIMIT_GI = 12
CHUNKS = 10  # 1 GiB each, with its 0.5 GiB context: 8.5 GiB borrowed above the request
KEEP = 2  # after the notice: 2.5 GiB in use, within the request and the grant left to it
PLUGIN = "app.kubernetes.io/name=vgpu-kubelet-plugin"

CUDA = """
import ctypes as C, signal, time
cu = C.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0, "cuInit failed"
dev, ctx, free, total = C.c_int(), C.c_void_p(), C.c_size_t(), C.c_size_t()
cu.cuDeviceGet(C.byref(dev), 0)
assert cu.cuCtxCreate_v2(C.byref(ctx), 0, dev) == 0, "no context"
cu.cuMemGetInfo_v2(C.byref(free), C.byref(total))
"""

# Allocates up to CHUNKS GiB (borrowing above its request), then frees down to KEEP at the
# plugin's notice and lives on.
BORROWER = (
    CUDA
    + f"""
held = []
while len(held) < {CHUNKS}:
    p = C.c_uint64()
    if cu.cuMemAlloc_v2(C.byref(p), C.c_size_t(1 << 30)) != 0:
        break
    held.append(p)
noticed = []
signal.signal(signal.SIGWINCH, lambda *a: noticed.append(1))
print(f"total={{total.value}} held={{len(held)}}", flush=True)
while not noticed:
    time.sleep(0.05)
while len(held) > {KEEP}:
    cu.cuMemFree_v2(held.pop())
print(f"freed to {{len(held)}}", flush=True)
time.sleep(100000)
"""
)


def newcomer(want: int) -> str:
    """Allocates `want` bytes at once, the moment its container starts."""
    return (
        CUDA
        + f"""
p = C.c_uint64()
rc = cu.cuMemAlloc_v2(C.byref(p), C.c_size_t({want}))
print(f"total={{total.value}} alloc={{rc}}", flush=True)
time.sleep(100000)
"""
    )


def pod(name: str, memory: int, program: str, limit_gi: int | None = None) -> str:
    """A claim of `memory` bytes and 5 cores of gpu-GPU (with a `memoryLimit` of `limit_gi`),
    and a pod running `program`."""
    config = None if limit_gi is None else {"memoryLimit": f"{limit_gi}Gi"}
    return claim_pod(name, None, 5, GPU, memory=str(memory), program=program, parameters=config)


def _plugin_log(cluster: Cluster) -> str:
    return cluster.kubectl("logs", "-n", PLUGIN_NS, "-l", PLUGIN, "--tail=-1").stdout


@pytest.fixture(scope="module")
def bursting(cluster: Cluster) -> Iterator[Cluster]:
    """The sim-watchdog overlay and a policy that lets claims burst (evict, 20 s grace); the
    sim overlay and the original policy again after."""
    require_sharing(cluster)
    original = policy_text(cluster)
    policy = yaml.safe_load(original)
    policy["default"]["burst"] = {
        "maxRatio": 8, "fromClaim": True, "reclaim": "evict", "grace": "20s",
    }  # fmt: skip
    try:
        rollout(cluster, "sim-watchdog")
        applied = _plugin_log(cluster).count(" applied: ")
        set_policy(cluster, yaml.safe_dump(policy))
        # the kubelet refreshes the mounted ConfigMap within about a minute
        cluster.wait_until(
            "the plugin applying the burst policy",
            lambda: _plugin_log(cluster).count(" applied: ") > applied,
            timeout=180,
            every=2,
        )
        yield cluster
    finally:
        set_policy(cluster, original)
        rollout(cluster, "sim")


def test_a_new_claim_gets_its_whole_request_back_from_a_borrower(
    bursting: Cluster, clean_default: Cluster
) -> None:
    cluster = clean_default
    capacity = cluster.published_memory(f"gpu-{GPU}")
    assert capacity > 0, cluster.slices()
    cluster.apply(pod("borrower", REQUEST_GI * GiB, BORROWER, limit_gi=LIMIT_GI))
    cluster.wait_pod("borrower", ("Running",))
    line = cluster.wait_until(
        "the borrower holding its memory",
        lambda: next((x for x in cluster.logs("borrower").splitlines() if "held=" in x), None),
        timeout=120,
    )
    # it is shown its request, and got all it asked for above it
    assert line == f"total={REQUEST_GI * GiB} held={CHUNKS}", line

    # The newcomer's request leaves 2 GiB of the device unallocated: the borrower's grant
    # falls from 10 GiB to 2, below the 8.5 GiB it borrows.
    step = 256 << 20
    request = (capacity - (REQUEST_GI + 2) * GiB) // step * step
    want = request - GiB  # its whole request but room for its own context
    cluster.apply(pod("newcomer", request, newcomer(want)))
    cluster.wait_pod("newcomer", ("Running",), timeout=300)
    got = cluster.wait_until(
        "the newcomer's allocation",
        lambda: next((x for x in cluster.logs("newcomer").splitlines() if "alloc=" in x), None),
        timeout=120,
    )
    assert got == f"total={request} alloc=0", got

    # The borrower was told, gave back, and lives.
    assert f"freed to {KEEP}" in cluster.logs("borrower"), cluster.logs("borrower")
    p = cluster.pod("borrower")
    assert p["status"]["phase"] == "Running", p["status"]
    assert p["status"]["containerStatuses"][0]["restartCount"] == 0, p["status"]

    def both() -> list[str] | None:
        e = cluster.events("borrower")
        reasons = {x.split(":", 1)[0] for x in e}
        return e if {"BurstReclaimNotice", "BurstReclaimed"} <= reasons else None

    events = cluster.wait_until("the notice and the reclaim as Events on its claim", both, 60)
    reclaimed = next(x for x in events if x.startswith("BurstReclaimed"))
    assert "claim default/newcomer" in reclaimed and "no process stopped" in reclaimed, events

"""The quota watchdog on the real cluster (deploy/overlays/sim-watchdog: the sim overlay with
hostPID, WATCHDOG=true and WATCHDOG_ENFORCE=kill, as deploy/base runs on GPU nodes).

A process in a claim's pod gets around the shim the way the shim cannot close (a copy of the
driver library under another name, loaded beside the one the shim hooks: docs/shim.md, "Threat
model") and allocates twice its share. The watchdog, in the plugin's pod, sees it through the
simulated NVML by its host PID, attributes it to the claim by the accounting file it has mapped,
counts the violation, posts a QuotaExceeded Event on the claim and stops the process; the
pod's other process, within its share, keeps running. The sim overlay is applied again after.

With the host's PIDs the exporter also attributes a claim's GPU processes to their containers:
a process holding memory within its share is left running and shows in the per-container
series (vgpu_container_memory_used_bytes) under its pod's and container's names.
"""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.kube import Cluster, claim_pod, require_sharing, rollout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

NS = "vgpu-sharing"
POD = "bypasser"
SHARE_GI = 2
BYPASS_GI = 2 * SHARE_GI
# The driver library the shim hooked, copied and loaded again under another name: a second
# driver instance whose calls the shim never sees (tests/c/bypass_copy.c, in Python).
BYPASS = f"""
import ctypes as C, shutil, time
C.CDLL("libcuda.so.1")
path = next(line.split()[-1] for line in open("/proc/self/maps")
            if line.rstrip().endswith("/libcuda.so.1"))
shutil.copy(path, "/tmp/bypass-driver.so")
cu = C.CDLL("/tmp/bypass-driver.so")
dev, ctx, ptr = C.c_int(), C.c_void_p(), C.c_uint64()
assert cu.cuInit(0) == 0
cu.cuDeviceGet(C.byref(dev), 0)
cu.cuCtxCreate_v2(C.byref(ctx), 0, dev)
print(f"held rc={{cu.cuMemAlloc_v2(C.byref(ptr), C.c_size_t({BYPASS_GI} << 30))}}", flush=True)
time.sleep(100000)
"""


@pytest.fixture(scope="module")
def watchdog_on(cluster: Cluster) -> Iterator[Cluster]:
    """The sim-watchdog overlay for this module's tests; the sim overlay again after them."""
    require_sharing(cluster)
    try:
        rollout(cluster, "sim-watchdog")
        [ds] = cluster.get("daemonsets", "-n", NS)["items"]
        assert ds["spec"]["template"]["spec"].get("hostPID") is True, ds["spec"]
        cluster.wait_until("the slices republished", cluster.slices, timeout=120)
        yield cluster
    finally:
        rollout(cluster, "sim")


@pytest.fixture
def watchdog(watchdog_on: Cluster, clean_default: Cluster) -> Cluster:
    return clean_default


def _metrics_url(cluster: Cluster) -> str:
    pods = cluster.get("pods", "-n", NS, "-l", "app.kubernetes.io/name=vgpu-kubelet-plugin")
    running = [p for p in pods["items"] if p["status"].get("phase") == "Running"]
    assert len(running) == 1, [p["metadata"]["name"] for p in pods["items"]]
    # hostPID does not put the pod in the host's network: its own address
    return f"http://{running[0]['status']['podIP']}:9402/metrics"


def _samples(url: str, family: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of one family; the parser drops a counter's _total."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return [
        (dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        if fam.name == family
        for s in fam.samples
    ]


def _violations(url: str, claim: str) -> float:
    samples = _samples(url, "vgpu_slice_quota_violations")
    return sum(v for labels, v in samples if labels.get("claim") == claim)


def test_a_process_around_the_shim_is_caught_and_stopped(watchdog: Cluster) -> None:
    cluster = watchdog
    cluster.apply(claim_pod(POD, SHARE_GI, 10))
    assert cluster.wait_output(POD) == {0: float(SHARE_GI)}
    url = _metrics_url(cluster)
    assert _violations(url, POD) == 0

    bypass = subprocess.Popen(
        ["kubectl", "exec", POD, "-c", "cuda", "--", "python3", "-c", BYPASS],
        env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = bypass.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        bypass.kill()
        out, err = bypass.communicate()
        raise AssertionError(f"the bypass still runs after 120 s: {out!r} {err!r}") from None
    # It did get past its share (else the test proves nothing), and was stopped from outside:
    # SIGTERM (143), or SIGKILL (137) after the grace.
    assert "held rc=0" in out, (out, err)
    assert bypass.returncode in (137, 143), (bypass.returncode, out, err)

    events = cluster.wait_until(
        "a QuotaExceeded Event on the claim",
        lambda: [e for e in cluster.events(POD) if e.startswith("QuotaExceeded")],
        timeout=60,
    )
    assert f"claim default/{POD} " in events[0] and "over its quota" in events[0], events
    assert "holding more than the shim charged: pid " in events[0], events
    violations = cluster.wait_until(
        "the violation counted", lambda: _violations(url, POD), timeout=60, every=2
    )
    assert violations == 1, violations
    # The pod's own process, within its share, is left alone.
    pod = cluster.pod(POD)
    assert pod["status"]["phase"] == "Running", pod["status"]
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["status"]


HOLD = """
import ctypes as C, time
cu = C.CDLL("libcuda.so.1")
dev, ctx, ptr = C.c_int(), C.c_void_p(), C.c_uint64()
assert cu.cuInit(0) == 0
cu.cuDeviceGet(C.byref(dev), 0)
cu.cuCtxCreate_v2(C.byref(ctx), 0, dev)
print(f"held rc={cu.cuMemAlloc_v2(C.byref(ptr), C.c_size_t(1 << 30))}", flush=True)
time.sleep(100000)
"""


def test_a_process_within_its_share_shows_under_its_pod_and_container(watchdog: Cluster) -> None:
    cluster = watchdog
    cluster.apply(claim_pod("holder", SHARE_GI, 10))
    cluster.wait_output("holder")
    url = _metrics_url(cluster)
    hold = subprocess.Popen(
        ["kubectl", "exec", "holder", "-c", "cuda", "--", "python3", "-c", HOLD],
        env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert hold.stdout is not None
        assert hold.stdout.readline().strip() == "held rc=0"

        def mine() -> list[float]:
            return [
                v
                for labels, v in _samples(url, "vgpu_container_memory_used_bytes")
                if labels.get("claim") == "holder"
                and (labels.get("pod"), labels.get("container")) == ("holder", "cuda")
                and v >= 1 << 30
            ]

        used = cluster.wait_until("the container's series", mine, timeout=60, every=2)
        assert len(used) == 1, used
        assert hold.poll() is None, "the watchdog stopped a process within its share"
        assert _violations(url, "holder") == 0
    finally:
        hold.kill()
        hold.communicate()

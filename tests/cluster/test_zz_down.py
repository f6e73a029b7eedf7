"""Last in the session (the name sorts last): a crash of every cluster process, then `up` again
recovers; `down` leaves no process, mount, network device, iptables rule or cgroup behind, and
restores the sysctls the node changed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.cluster.kube import (
    BRIDGE,
    RUN,
    SCRIPT,
    Cluster,
    cluster_cgroups,
    cluster_iptables,
    cluster_mounts,
    cluster_processes,
    cni_host_veths,
    host_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]


def test_up_after_a_crash_recovers(cluster: Cluster) -> None:
    # Every host process of the cluster killed at once, as a crash leaves them: containers,
    # mounts, cgroups and rules stay behind.
    for f in (RUN / "pids").glob("*.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(f.read_text()), signal.SIGKILL)
    r = subprocess.run([str(SCRIPT), "up", "--kubernetes", cluster.version], capture_output=True,
                       text=True, timeout=1800)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    print(f"\n{r.stderr}")
    node = cluster.get("nodes")["items"]
    assert len(node) == 1
    ready = [c for c in node[0]["status"]["conditions"] if c["type"] == "Ready"]
    assert ready[0]["status"] == "True", node[0]["status"]["conditions"]


def test_down_leaves_nothing_behind(cluster: Cluster) -> None:
    # A pod on the pod network first, so that there is a veth, a network namespace and mounts.
    cluster.apply(
        """
apiVersion: v1
kind: Pod
metadata: {name: sleeper, namespace: default}
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - {name: c, image: "localhost/pause:3.10"}  # the one image every `up` loads
"""
    )
    cluster.wait_pod("sleeper", ("Running",), timeout=180)
    veths = cni_host_veths()
    netns = {p.name for p in Path("/run/netns").glob("cni-*")}
    assert netns, "no network namespace for the pod"
    assert veths, "no veth in libcni's cache for the pod"
    assert cluster_mounts() and cluster_cgroups() and cluster_processes()

    r = subprocess.run([str(SCRIPT), "down"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr

    assert cluster_processes() == []
    assert cluster_mounts() == []
    assert cluster_cgroups() == []
    assert cluster_iptables() == []
    after = host_state()
    assert BRIDGE not in after.links
    assert not set(veths) & after.links, veths
    assert cluster.host_before is not None
    assert after.sysctls == cluster.host_before.sysctls
    started = RUN / "started"
    assert not started.exists()
    assert not netns & {p.name for p in Path("/run/netns").glob("cni-*")}
    assert not list(Path("/var/lib/cni/results").glob("vgpu-cluster-*"))
    status = subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True)
    assert "running" not in status.stdout, status.stdout

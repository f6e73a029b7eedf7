"""The real cluster: `scripts/cluster up --with-driver` once per session, `down` at the end.

VGPU_TEST_CLUSTER=0 skips every test here, saying so. Otherwise a missing prerequisite (not
root, no Go, no podman...) is a skip with the reason outside CI and a failure on CI (CI=true):
CI never skips the cluster. VGPU_TEST_CLUSTER_KEEP=1 leaves the cluster running afterwards
(for looking at it; `scripts/cluster down` removes it); VGPU_TEST_CLUSTER_REUSE=1 runs against a
cluster already up instead of starting one (the host-state baseline of test_zz_down is then
taken with the cluster running, so only run the other modules that way). The first run builds Kubernetes,
etcd and containerd from the Go module proxy (25-45 min on two cores); later runs start in
about a minute.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.cluster.kube import CACHE, RUN, SCRIPT, Cluster, host_state, publish_mode

VERSION = os.environ.get("VGPU_CLUSTER_KUBERNETES", "1.37.2")


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "the cluster needs root (the kubelet, containerd, a bridge)"
    for tool, pkg in (("go", "Go 1.26"), ("podman", "podman"), ("openssl", "openssl")):
        if shutil.which(tool) is None:
            return f"{tool} missing: install {pkg}"
    return None


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if os.environ.get("VGPU_TEST_CLUSTER") == "0":
        pytest.skip("VGPU_TEST_CLUSTER=0: the real-cluster tests are left out of this run")
    if why := _why_not():
        if os.environ.get("CI") == "true":
            pytest.fail(f"real-cluster tests cannot run on CI: {why}")
        pytest.skip(why)
    reuse = os.environ.get("VGPU_TEST_CLUSTER_REUSE") == "1" and (RUN / "admin.kubeconfig").exists()
    before = host_state()
    t = time.monotonic()
    if not reuse:
        r = subprocess.run(
            [str(SCRIPT), "up", "--kubernetes", VERSION, "--with-driver"],
            capture_output=True,
            text=True,
            timeout=5400,
        )
        if r.returncode != 0:
            subprocess.run([str(SCRIPT), "down"], capture_output=True, timeout=600)
            pytest.fail(f"scripts/cluster up failed (rc={r.returncode}):\n{r.stderr[-6000:]}")
        print(f"\n{r.stderr}")  # the progress lines, for -s / the report
    up_seconds = time.monotonic() - t
    bin_dir = CACHE / f"k8s-{VERSION}" / "bin"
    env = dict(os.environ, KUBECONFIG=str(RUN / "admin.kubeconfig"))
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    c = Cluster(env=env, version=VERSION, up_seconds=up_seconds, host_before=before)
    c.mode = publish_mode(c.wait_until("ResourceSlices", c.slices, timeout=120))
    try:
        yield c
    finally:
        if os.environ.get("VGPU_TEST_CLUSTER_KEEP") != "1":
            subprocess.run([str(SCRIPT), "down"], capture_output=True, timeout=600)


@pytest.fixture
def clean_default(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, with the test's pods and claims in `default` removed afterwards."""
    yield cluster
    cluster.kubectl(
        "delete", "pods,resourceclaims,resourceclaimtemplates", "--all", "-n", "default",
        "--wait=true", "--timeout=180s", check=False, timeout=240,
    )  # fmt: skip

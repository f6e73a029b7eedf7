"""deploy/base/admission.yaml enforced by the real API server: a pod with a claim that mounts a
volume over a path the plugin injects is refused, and so is one whose mount path climbs to them
with a '..' segment (the runtime resolves it inside the container's root); the same pod mounting
elsewhere, or at a path whose dots make no '..' segment, is admitted."""

from __future__ import annotations

import pytest

from tests.cluster.kube import DRIVER, Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

POLICY = "vgpu-sharing-pod-mounts"


def _pod(name: str, mount_path: str) -> str:
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: {name}
  namespace: default
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: {DRIVER}
---
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: default
spec:
  securityContext:
    seccompProfile: {{type: RuntimeDefault}}  # claim pods need one (deploy/base/admission.yaml)
  restartPolicy: Never
  resourceClaims:
    - name: gpu
      resourceClaimTemplateName: {name}
  volumes:
    - name: mine
      emptyDir: {{}}
  containers:
    - name: c
      image: python:3.12-slim
      command: ["true"]
      volumeMounts:
        - name: mine
          mountPath: {mount_path}
      resources:
        claims:
          - name: gpu
"""


@pytest.mark.parametrize(
    "path",
    [
        "/etc/ld.so.preload",
        "/usr/local/lib/vgpu-sharing",
        "/run/vgpu-sharing",
        "/etc",
        "//usr/./local/lib/",
    ],
)
def test_the_api_server_refuses_a_mount_over_the_shims_paths(
    clean_default: Cluster, path: str
) -> None:
    r = clean_default.kubectl("apply", "-f", "-", input=_pod("mounts-shim", path), check=False)
    assert r.returncode != 0, r.stdout
    assert POLICY in r.stderr, r.stderr
    assert "denied request" in r.stderr or "Forbidden" in r.stderr, r.stderr
    got = clean_default.kubectl("get", "pod", "mounts-shim", check=False)
    assert got.returncode != 0 and "NotFound" in got.stderr


def test_a_mount_elsewhere_is_admitted(clean_default: Cluster) -> None:
    r = clean_default.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=_pod("mounts-data", "/data"), check=False
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "path",
    [
        "/tmp/../etc/ld.so.preload",
        "/data/../usr/local/lib/vgpu-sharing",
        "/srv/x/../../run/vgpu-sharing/",
        "/..",
    ],
)
def test_the_api_server_refuses_a_mount_path_that_climbs_with_dot_dot(
    clean_default: Cluster, path: str
) -> None:
    r = clean_default.kubectl("apply", "-f", "-", input=_pod("mounts-climb", path), check=False)
    assert r.returncode != 0, r.stdout
    # Refused by our policy's own rule, not by the API server's validation of the pod.
    assert POLICY in r.stderr, r.stderr
    assert "a path with a '..' segment" in r.stderr, r.stderr
    got = clean_default.kubectl("get", "pod", "mounts-climb", check=False)
    assert got.returncode != 0 and "NotFound" in got.stderr


def test_dots_that_make_no_dot_dot_segment_are_admitted(clean_default: Cluster) -> None:
    r = clean_default.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=_pod("mounts-dots", "/data/..x"), check=False
    )
    assert r.returncode == 0, r.stderr

"""The plugin's ServiceAccount has least privilege, as the real API server's RBAC authorizer sees
deploy/base/rbac.yaml: `kubectl auth can-i` for what the plugin does, and for what it must not."""

from __future__ import annotations

import pytest

from tests.cluster.kube import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

SA = "system:serviceaccount:vgpu-sharing:vgpu-kubelet-plugin"

# (verb, resource, allowed): the calls the plugin makes, then neighbours it must not have.
TABLE = [
    ("create", "resourceslices.resource.k8s.io", True),
    ("update", "resourceslices.resource.k8s.io", True),
    ("delete", "resourceslices.resource.k8s.io", True),
    ("list", "resourceslices.resource.k8s.io", True),
    ("get", "resourceclaims.resource.k8s.io", True),
    ("patch", "resourceclaims.resource.k8s.io/status", True),
    ("get", "nodes", True),
    ("create", "events", True),
    ("list", "resourceclaims.resource.k8s.io", False),
    ("update", "resourceclaims.resource.k8s.io", False),
    ("delete", "resourceclaims.resource.k8s.io", False),
    ("patch", "resourceclaims.resource.k8s.io", False),
    ("create", "deviceclasses.resource.k8s.io", False),
    ("update", "deviceclasses.resource.k8s.io", False),
    ("list", "nodes", False),
    ("update", "nodes", False),
    ("patch", "nodes/status", False),
    ("get", "secrets", False),
    ("list", "pods", False),
    ("create", "pods", False),
    ("delete", "pods", False),
    ("update", "configmaps", False),
]


@pytest.mark.parametrize(("verb", "resource", "allowed"), TABLE)
def test_plugin_service_account_can_exactly(
    cluster: Cluster, verb: str, resource: str, allowed: bool
) -> None:
    resource, _, sub = resource.partition("/")
    extra = [f"--subresource={sub}"] if sub else []
    r = cluster.kubectl("auth", "can-i", verb, resource, *extra, "--as", SA, "-A", check=False)
    answer = r.stdout.strip()
    assert answer == ("yes" if allowed else "no"), (verb, resource, r.stdout, r.stderr)

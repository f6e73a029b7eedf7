"""The fake API server behaves like the real one where the driver depends on it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client import CoreV1Api, ResourceV1Api
from kubernetes.client.exceptions import ApiException

from tests.fakes.apiserver import FakeApiServer, parse_quantity, validate_resource_slice

DRIVER = "vgpu.sharing.dev"


def slice_body(
    name: str, node: str = "node-a", devices: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices if devices is not None else [{"name": "gpu-0"}],
        },
    }


def shared_device(name: str = "gpu-0") -> dict[str, Any]:
    return {
        "name": name,
        "allowMultipleAllocations": True,
        "attributes": {"index": {"int": 0}, "driverVersion": {"version": "550.54.15"}},
        "capacity": {
            "memory": {
                "value": "80Gi",
                "requestPolicy": {
                    "default": "80Gi",
                    "validRange": {"min": "256Mi", "max": "80Gi", "step": "256Mi"},
                },
            },
            "cores": {
                "value": "100",
                "requestPolicy": {"default": "100", "validRange": {"min": "1", "step": "1"}},
            },
        },
    }


def claim_body(namespace: str) -> dict[str, Any]:
    """ResourceClaim "c" with request "gpu", allocated gpu-0 of node-a."""
    result = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


@pytest.fixture
def server() -> Any:
    with FakeApiServer() as s:
        yield s


def test_create_get_list_with_field_selector(server: FakeApiServer) -> None:
    api = ResourceV1Api(server.api_client())
    api.create_resource_slice(slice_body("a", "node-a"))
    api.create_resource_slice(slice_body("b", "node-b"))
    got = api.read_resource_slice("a")
    assert got.spec.node_name == "node-a"
    assert got.metadata.resource_version and got.metadata.uid
    listed = api.list_resource_slice(field_selector="spec.nodeName=node-b")
    assert [s.metadata.name for s in listed.items] == ["b"]
    listed = api.list_resource_slice(field_selector=f"spec.driver={DRIVER},spec.nodeName!=node-b")
    assert [s.metadata.name for s in listed.items] == ["a"]
    with pytest.raises(ApiException) as e:
        api.list_resource_slice(field_selector="spec.pool.generation=1")
    assert e.value.status == 400 and "field label not supported" in e.value.body


def test_schema_violation_is_422_with_status(server: FakeApiServer) -> None:
    # The typed client refuses unknown fields itself, so send the raw JSON.
    body = slice_body("a")
    body["spec"]["devices"][0]["bogus"] = 1
    req = urllib.request.Request(
        f"{server.url}/apis/resource.k8s.io/v1/resourceslices",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 422
    status = json.loads(e.value.read())
    assert status["kind"] == "Status" and status["reason"] == "Invalid" and status["code"] == 422
    assert "bogus" in status["message"]
    assert server.objects("ResourceSlice") == []
    # A semantic violation the client cannot see arrives through the client as a 422 too.
    api = ResourceV1Api(server.api_client())
    with pytest.raises(ApiException) as ae:
        api.create_resource_slice(slice_body("a", devices=[{"name": "GPU_0"}]))
    assert ae.value.status == 422 and "spec.devices[0].name" in ae.value.body


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.update(name="GPU_0"), "RFC 1123 label"),
        (lambda d: d["attributes"].update(v={"version": "9.0"}), "semantic version"),
        (lambda d: d["attributes"].update(v={"int": 1, "string": "x"}), "exactly one value"),
        (lambda d: d.pop("allowMultipleAllocations"), "only allowed when allowMultipleAllocations"),
        (
            lambda d: d["capacity"]["memory"]["requestPolicy"].update(default="1000Mi"),
            "multiple of step",
        ),
        (
            lambda d: d["capacity"]["memory"]["requestPolicy"]["validRange"].update(max="80000Mi"),
            "max - min must be a multiple of step",
        ),
    ],
)
def test_semantic_rules(mutate: Any, needle: str) -> None:
    dev = shared_device()
    mutate(dev)
    errs = validate_resource_slice(slice_body("a", devices=[dev]))
    assert any(needle in m for _, m in errs), errs


def test_too_many_devices_and_node_selection() -> None:
    devs = [{"name": f"gpu-{i}"} for i in range(129)]
    errs = validate_resource_slice(slice_body("a", devices=devs))
    assert any("at most 128" in m for _, m in errs)
    assert validate_resource_slice(slice_body("a", devices=devs[:128])) == []
    body = slice_body("a")
    body["spec"]["allNodes"] = True
    assert any("exactly one of" in m for _, m in validate_resource_slice(body))


def test_quantities() -> None:
    assert parse_quantity("256Mi") == 256 * 2**20
    assert parse_quantity("1.5G") == 1_500_000_000
    assert parse_quantity(100) == 100
    assert parse_quantity("500m") * 2 == 1
    with pytest.raises(ValueError):
        parse_quantity("4 GiB")


def test_drop_consumable_capacity() -> None:
    with FakeApiServer(drop_consumable_capacity=True) as server:
        api = ResourceV1Api(server.api_client())
        api.create_resource_slice(slice_body("a", devices=[shared_device()]))
        dev = api.read_resource_slice("a").spec.devices[0]
        assert dev.allow_multiple_allocations is None
        assert dev.capacity["memory"].request_policy is None
        assert dev.capacity["memory"].value == "80Gi"
    with FakeApiServer() as server:
        api = ResourceV1Api(server.api_client())
        api.create_resource_slice(slice_body("a", devices=[shared_device()]))
        dev = api.read_resource_slice("a").spec.devices[0]
        assert dev.allow_multiple_allocations is True
        assert dev.capacity["memory"].request_policy.valid_range.step == "256Mi"


def test_update_conflict_delete(server: FakeApiServer) -> None:
    api = ResourceV1Api(server.api_client())
    created = api.create_resource_slice(slice_body("a"))
    with pytest.raises(ApiException) as e:
        api.create_resource_slice(slice_body("a"))
    assert e.value.status == 409 and "AlreadyExists" in e.value.body
    created.spec.pool.generation = 2
    updated = api.replace_resource_slice("a", created)
    assert updated.spec.pool.generation == 2
    assert updated.metadata.generation == 2
    created.spec.pool.generation = 3  # stale resourceVersion
    with pytest.raises(ApiException) as e:
        api.replace_resource_slice("a", created)
    assert e.value.status == 409 and "Conflict" in e.value.body
    api.delete_resource_slice("a")
    with pytest.raises(ApiException) as e:
        api.read_resource_slice("a")
    assert e.value.status == 404


def test_claims_nodes_and_put_helpers(server: FakeApiServer) -> None:
    node = server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}})
    claim = server.put(claim_body("ns1"))
    client = server.api_client()
    assert CoreV1Api(client).read_node("node-a").metadata.uid == node["metadata"]["uid"]
    got = ResourceV1Api(client).read_namespaced_resource_claim("c", "ns1")
    assert got.metadata.uid == claim["metadata"]["uid"]
    assert got.status.allocation.devices.results[0].device == "gpu-0"
    assert server.get("ResourceClaim", "ns1", "c") is not None
    assert server.get("ResourceClaim", "other", "c") is None
    with pytest.raises(ApiException) as e:
        ResourceV1Api(client).read_namespaced_resource_claim("c", "other")
    assert e.value.status == 404
    bad = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}, "spec": {"nope": 1}}
    with pytest.raises(Exception, match="nope"):
        server.put(bad)


def test_down_and_up_keep_store_and_port(server: FakeApiServer, tmp_path: Path) -> None:
    api = ResourceV1Api(server.api_client())
    api.create_resource_slice(slice_body("a"))
    port = server.port
    server.down()
    with pytest.raises(Exception):  # noqa: B017 - urllib3 raises MaxRetryError/ProtocolError
        api.read_resource_slice("a", _request_timeout=2)
    server.up()
    assert server.port == port
    assert api.read_resource_slice("a").metadata.name == "a"
    # A subprocess-style client configured from the kubeconfig reaches the same server.
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
        str(server.kubeconfig_path(tmp_path)), client_configuration=cfg
    )
    other = ResourceV1Api(kubernetes.client.ApiClient(cfg))
    assert [s.metadata.name for s in other.list_resource_slice().items] == ["a"]


def test_drop_consumable_capacity_on_claims() -> None:
    claim = claim_body("default")
    claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {"requests": {"memory": "4Gi"}}
    claim["status"]["allocation"]["devices"]["results"][0] |= {
        "consumedCapacity": {"memory": "4Gi"},
        "shareID": "0b7f3a38-8f3c-4e44-9a43-2f7d5e2b6a10",
    }
    with FakeApiServer(drop_consumable_capacity=True) as server:
        stored = server.put(claim)
        assert "capacity" not in stored["spec"]["devices"]["requests"][0]["exactly"]
        res = stored["status"]["allocation"]["devices"]["results"][0]
        assert "consumedCapacity" not in res and "shareID" not in res
    with FakeApiServer() as server:
        res = server.put(claim)["status"]["allocation"]["devices"]["results"][0]
        assert res["consumedCapacity"] == {"memory": "4Gi"}


def test_what_the_plugin_does_not_use_is_refused(server: FakeApiServer) -> None:
    """Watch, label selectors, patch (but a claim's status apply) and deletecollection are not served: a test that starts
    to need one fails loudly instead of passing against a half-made feature."""
    api = ResourceV1Api(server.api_client())
    api.create_resource_slice(slice_body("a"))
    with pytest.raises(ApiException) as e:
        api.list_resource_slice(label_selector="app=x")
    assert e.value.status == 400 and "labelSelector" in e.value.body
    with pytest.raises(ApiException) as e:
        api.list_resource_slice(watch=True)
    assert e.value.status == 400 and "watch" in e.value.body
    with pytest.raises(ApiException) as e:
        api.patch_resource_slice("a", {"spec": {"pool": {"generation": 5}}})
    assert e.value.status == 405 and "only PATCH of resourceclaims/<name>/status" in e.value.body
    with pytest.raises(ApiException) as e:
        api.delete_collection_resource_slice()
    assert e.value.status == 405
    assert server.get("ResourceSlice", None, "a") is not None

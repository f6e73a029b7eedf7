"""Every manifest in deploy/ is valid for Kubernetes 1.34 and 1.35 (strict schemas), and fits
the plugin: RBAC, mounts, env twins, device class selectors, example requests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from driver.flags import parse
from driver.resourceslices import MEMORY_MIN, MEMORY_STEP
from sharing.quantity import parse_bytes

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
VERSIONS = ("1.34", "1.35")


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.relative_to(DEPLOY).parts[0] == "prometheus":
            continue  # Prometheus rule files, not Kubernetes objects: tests/obs/test_dashboard.py
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((f"{path.relative_to(DEPLOY)}#{i}", doc))
    return docs


DOCS = documents()


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in DOCS if d["kind"] == kind]


def test_deploy_has_the_expected_objects() -> None:
    kinds = {d["kind"] for _, d in DOCS}
    assert {
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "DeviceClass",
        "ResourceClaimTemplate",
        "Pod",
    } <= kinds
    assert (DEPLOY / "README.md").is_file()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("where", "doc"), DOCS, ids=[w for w, _ in DOCS])
def test_manifest_is_valid_strict(where: str, doc: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message} ({version})")


def test_strict_validation_catches_a_typo() -> None:
    """The check above can fail: a misspelt field is rejected."""
    [ds] = of_kind("DaemonSet")
    bad = yaml.safe_load(yaml.safe_dump(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.34", strict=True)


def test_rbac_grants_exactly_the_plugin_verbs() -> None:
    [role] = of_kind("ClusterRole")
    grants = {
        (group, res): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for res in rule["resources"]
    }
    assert grants == {
        ("resource.k8s.io", "resourceslices"): {"get", "list", "create", "update", "delete"},
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("", "nodes"): {"get"},
        ("", "events"): {"create"},
    }
    [binding] = of_kind("ClusterRoleBinding")
    [sa] = of_kind("ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": sa["metadata"]["name"],
            "namespace": sa["metadata"]["namespace"],
        }
    ]


def test_daemonset_mounts_env_and_probe() -> None:
    [ds] = of_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    [sa] = of_kind("ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert ds["metadata"]["namespace"] == sa["metadata"]["namespace"]
    [c] = pod["containers"]
    assert c["command"] == ["vgpu-kubelet-plugin"]
    assert c["securityContext"]["privileged"] is True
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    # The env values parse as the plugin's flags, and every path it uses is the same host path.
    s = parse([], env={k: v or "node-x" for k, v in env.items()})
    for path in (
        s.kubelet_registrar_directory_path,
        s.kubelet_plugins_directory_path,
        s.cdi_root,
        s.data_dir,
        Path("/dev"),
    ):
        assert mounts.get(str(path)) == str(path), f"{path} not mounted from the same host path"
    assert next(e for e in c["env"] if e["name"] == "NODE_NAME")["valueFrom"]["fieldRef"] == {
        "fieldPath": "spec.nodeName"
    }
    probe = c["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    port = {p["name"]: p["containerPort"] for p in c["ports"]}[probe["port"]]
    assert s.healthcheck_port == port


def test_device_classes_select_our_driver() -> None:
    classes = {d["metadata"]["name"]: d for d in of_kind("DeviceClass")}
    assert "vgpu.sharing.dev" in classes
    for dc in classes.values():
        exprs = [s["cel"]["expression"] for s in dc["spec"]["selectors"]]
        assert any('device.driver == "vgpu.sharing.dev"' in e for e in exprs)


def test_example_requests_fit_the_published_policies() -> None:
    names = {d["metadata"]["name"] for d in of_kind("DeviceClass")}
    seen_capacity = False
    for tpl in of_kind("ResourceClaimTemplate"):
        for req in tpl["spec"]["spec"]["devices"]["requests"]:
            exactly = req["exactly"]
            assert exactly["deviceClassName"] in names
            caps = (exactly.get("capacity") or {}).get("requests") or {}
            if "memory" in caps:
                seen_capacity = True
                mem = parse_bytes(caps["memory"])
                assert mem >= MEMORY_MIN and (mem - MEMORY_MIN) % MEMORY_STEP == 0
            if "cores" in caps:
                assert 1 <= int(caps["cores"]) <= 100
    assert seen_capacity
    # The pods reference claims their templates define.
    templates = {t["metadata"]["name"] for t in of_kind("ResourceClaimTemplate")}
    for pod in of_kind("Pod"):
        claims = {c["name"]: c["resourceClaimTemplateName"] for c in pod["spec"]["resourceClaims"]}
        assert set(claims.values()) <= templates
        for c in pod["spec"]["containers"]:
            for ref in c["resources"]["claims"]:
                assert ref["name"] in claims
    two = [p for p in of_kind("Pod") if len(p["spec"]["containers"]) == 2]
    assert two, "an example with two containers sharing one claim"


def test_readme_mentions_every_manifest() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in DEPLOY.rglob("*.yaml"):
        assert str(path.relative_to(DEPLOY)) in readme, path
    assert re.search(r"kubectl apply", readme)

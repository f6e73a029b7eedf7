"""deploy/components/prometheus-operator: the optional ServiceMonitor and PrometheusRule. The rule
object is deploy/prometheus/rules.yaml unchanged (generated from it); both objects validate
strictly against the operator's CRD schemas (their openAPIV3Schema, kept in
tests/deploy/fixtures/prometheus-operator-crds.json with the commit they come from: no schema
package of the operator's CRDs is available to install); the component renders on an overlay,
and with it every object still validates for each Kubernetes version."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.dashboard_queries import RULES
from tests.support.deploy_tree import DEPLOY, VERSIONS, with_component

COMPONENT = DEPLOY / "components" / "prometheus-operator"
CRDS = Path(__file__).parent / "fixtures" / "prometheus-operator-crds.json"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "vgpu_promrule_generate", COMPONENT / "generate_rule.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as the API server's strict field validation applies it: an object with
    declared properties takes no other field (unless it preserves unknown fields)."""
    s = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            pat = node.get("pattern")
            if isinstance(pat, str) and pat.startswith("^(?i)"):
                node["pattern"] = (
                    "(?i)^" + pat[5:]
                )  # Go's RE2 takes the flag anywhere, Python first
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


def crd_schema(doc: dict[str, Any]) -> dict[str, Any]:
    fixture = json.loads(CRDS.read_text())
    entry = fixture["schemas"][f"{doc['apiVersion']}/{doc['kind']}"]
    assert entry["served"], entry
    schema: dict[str, Any] = entry["openAPIV3Schema"]
    return _strict(schema)


def validate_crd(doc: dict[str, Any]) -> None:
    jsonschema.validate(doc, crd_schema(doc))


def component_objects() -> list[dict[str, Any]]:
    return [d for f in ("servicemonitor.yaml", "prometheusrule.yaml")
            for d in yaml.safe_load_all((COMPONENT / f).read_text()) if d]  # fmt: skip


def test_the_fixture_names_its_source() -> None:
    fixture = json.loads(CRDS.read_text())
    assert fixture["source"].startswith("https://github.com/prometheus-operator/")
    assert len(fixture["commit"]) == 40
    assert set(fixture["schemas"]) == {"monitoring.coreos.com/v1/ServiceMonitor",
                                       "monitoring.coreos.com/v1/PrometheusRule"}  # fmt: skip


def test_prometheusrule_is_the_rules_file() -> None:
    committed = (COMPONENT / "prometheusrule.yaml").read_text()
    assert committed == _generator().render(), (
        "deploy/components/prometheus-operator/prometheusrule.yaml is out of date: run "
        "python deploy/components/prometheus-operator/generate_rule.py"
    )
    [rule] = [d for d in component_objects() if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_objects_are_valid_for_the_operators_crds() -> None:
    objs = component_objects()
    assert {d["kind"] for d in objs} == CRD_KINDS
    for d in objs:
        validate_crd(d)


def test_strict_crd_validation_catches_a_typo_and_a_wrong_type() -> None:
    """The check above can fail."""
    [sm] = [d for d in component_objects() if d["kind"] == "ServiceMonitor"]
    typo = copy.deepcopy(sm)
    typo["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        validate_crd(typo)
    [rule] = [d for d in component_objects() if d["kind"] == "PrometheusRule"]
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][0]["rules"] = "not a list"
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(bad)


@pytest.mark.slow
def test_component_renders_on_an_overlay_and_everything_validates() -> None:
    docs = with_component("prometheus-operator")
    [sm] = [x for x in docs if x["kind"] == "ServiceMonitor"]
    [rule] = [x for x in docs if x["kind"] == "PrometheusRule"]
    [svc] = [x for x in docs if x["kind"] == "Service"]
    # the ServiceMonitor finds the metrics Service and its port
    assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"]
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]]
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    # the job the rules' VgpuExporterDown expects
    [job] = [x for x in sm["spec"]["endpoints"][0]["relabelings"] if x["targetLabel"] == "job"]
    assert job["replacement"] == "vgpu-sharing"
    for x in (sm, rule):
        validate_crd(x)
    failures = []
    for version in VERSIONS:
        for x in docs:
            if x["kind"] in CRD_KINDS:
                continue
            try:
                kubernetes_validate.validate(x, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                failures.append(f"{version} {x['kind']}/{x['metadata']['name']}: {e.message}")
    assert not failures, "\n".join(failures)

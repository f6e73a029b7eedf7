"""The committed dashboard and rules, as the tests read them: every PromQL query of the
dashboard (variables substituted as Grafana would with "All" selected) and every rule."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "vgpu-sharing.json"
GENERATOR = REPO / "deploy" / "grafana" / "generate.py"
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
RULES_TEST = REPO / "deploy" / "prometheus" / "rules.test.yaml"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vgpu_dashboard_generate", GENERATOR)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def substitute(expr: str, rate_interval: str = "1m") -> str:
    """Grafana's substitution with every variable at "All" (allValue ".*")."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$(Hostname|namespace|claim)\b", ".*", expr)


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    return [
        (p["title"], substitute(t["expr"]))
        for p in dashboard()["panels"]
        for t in p.get("targets") or []
    ]


def variable_queries() -> list[tuple[str, str, str]]:
    """(variable, series selector, label) of every label_values() variable."""
    out = []
    for v in dashboard()["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.*), (\w+)\)", v["query"])
        assert m, v["query"]
        out.append((v["name"], substitute(m.group(1)), m.group(2)))
    return out


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


HAMI_QUERIES = Path(__file__).parent / "fixtures" / "hami-vgpu-dashboard.queries.json"


def hami_dashboard() -> dict[str, Any]:
    """HAMi's published dashboard's queries (the fixture names its source and commit)."""
    doc: dict[str, Any] = json.loads(HAMI_QUERIES.read_text())
    return doc


def hami_panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of HAMi's dashboard, its variables at "All"."""
    return [
        (p["title"], re.sub(r"\$(node|namespace)\b", ".*", p["expr"]))
        for p in hami_dashboard()["panels"]
    ]


def hami_variable_queries() -> list[tuple[str, str, str]]:
    """(variable, series selector, label) of HAMi's label_values() variables."""
    out = []
    for v in hami_dashboard()["variables"]:
        m = re.fullmatch(r"label_values\((.*), (\w+)\)", v["query"])
        assert m, v["query"]
        out.append((v["name"], m.group(1), m.group(2)))
    return out

"""The dashboard is generated code: the committed JSON is the generator's output, and it has the
variables and panels the issue lists. Alerts: promtool checks and unit-tests every one."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy.dashboard_queries import (
    DASHBOARD,
    RULES,
    RULES_TEST,
    dashboard,
    generator,
    panel_queries,
    rules,
)


def test_committed_json_is_the_generators_output() -> None:
    assert DASHBOARD.read_text() == generator().render(), (
        "deploy/grafana/vgpu-sharing.json is out of date: run python deploy/grafana/generate.py"
    )


def test_variables_and_panels() -> None:
    d = dashboard()
    assert [v["name"] for v in d["templating"]["list"]] == [
        "datasource", "Hostname", "namespace", "claim",
    ]  # fmt: skip
    assert all(
        t["datasource"]["uid"] == "${datasource}" for p in d["panels"] for t in p.get("targets", [])
    )
    exprs = " ".join(q for _, q in panel_queries())
    for needed in (
        "vgpu_slice_memory_limit_bytes", "vgpu_slice_memory_used_bytes",
        "vgpu_slice_compute_limit_ratio", "vgpu_slice_compute_used_ratio",
        "vgpu_slice_throttled_seconds_total", "vgpu_slice_alloc_denied_total",
        "vgpu_slice_quota_violations_total", "vgpu_device_memory_allocated_bytes",
        "vgpu_device_cores_allocated_ratio", "up{", "vgpu_exporter_scrape_duration_seconds",
    ):  # fmt: skip
        assert needed in exprs, needed


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is missing (Debian package prometheus; scripts/setup installs it)")
    return tool


def test_promtool_checks_the_rules() -> None:
    r = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout, r.stdout


@pytest.mark.slow
def test_promtool_unit_tests_every_alert() -> None:
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts >= {
        "VgpuSliceNearMemoryQuota", "VgpuSliceThrottled", "VgpuQuotaViolation", "VgpuExporterDown",
        "VgpuShimNotLoaded", "VgpuSliceUnreadable",
    }  # fmt: skip
    tested = {
        t["alertname"]
        for case in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for t in case.get("alert_rule_test", [])
        if t.get("exp_alerts")
    }
    assert tested == alerts, f"alerts without a firing unit test: {sorted(alerts - tested)}"
    r = subprocess.run(
        [_promtool(), "test", "rules", RULES_TEST.name],
        capture_output=True,
        text=True,
        cwd=RULES_TEST.parent,
    )
    assert r.returncode == 0, r.stdout + r.stderr

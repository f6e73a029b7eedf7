"""A real Prometheus (Debian's package) scrapes a real `vgpu exporter` while two tenants run under
the shim on the simulated GPU: every dashboard panel query, every variable and every recording
rule returns at least one series through Prometheus' HTTP API, and every rule evaluates cleanly.
The same for HAMi's published dashboard (its queries kept in tests/deploy/fixtures with their
source): every panel renders from our exporter."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharing.paths import shim_library
from tests.deploy.dashboard_queries import (
    RULES,
    hami_dashboard,
    hami_panel_queries,
    hami_variable_queries,
    panel_queries,
    rules,
    variable_queries,
)
from tests.fakes.apiserver import free_port
from tests.support.observers import ExporterProcess, MiB, add_claim, sim_gpu_uuid, start_tenant
from tests.support.shim_ops import Held

pytestmark = pytest.mark.slow
JOB = "vgpu-sharing"


class Prometheus:
    def __init__(self, tmp: Path, target: str) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.skip(
                "prometheus is missing (Debian package prometheus; scripts/setup installs it)"
            )
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [target]}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (tmp / "prometheus.log").open("w+")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not start: {self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def api(self, path: str, **params: str) -> Any:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture
def prometheus_setup(
    sim_env: dict[str, str], tmp_path: Path
) -> Iterator[tuple[Prometheus, Path, Path]]:
    """Two prepared claims in a plugin data directory (namespaces team-a, team-b)."""
    data = tmp_path / "data"
    uuid = sim_gpu_uuid(sim_env)
    a = add_claim(data, "uid-a", "train", uuid, 1 << 30, 30, ns="team-a") / "accounting"
    b = add_claim(data, "uid-b", "infer", uuid, 2 << 30, 50, ns="team-b") / "accounting"
    exp = ExporterProcess(["--sim", "--data-dir", str(data), "--hostname", "node-1"], sim_env)
    prom = None
    try:
        prom = Prometheus(tmp_path, exp.url.removeprefix("http://"))
        yield prom, a, b
    finally:
        if prom is not None:
            prom.stop()
        exp.stop()


def _eventually(prom: Prometheus, expr: str, deadline: float) -> list[dict[str, Any]]:
    while True:
        got = prom.query(expr)
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_every_panel_query_and_rule_returns_series(
    prometheus_setup: tuple[Prometheus, Path, Path],
    sim_env: dict[str, str],
    build_c: Any,
) -> None:
    prom, a, b = prometheus_setup
    work = ["--chunk-mib", "256", "--max-chunks", "16", "--seconds", "8"]
    tenants = [
        # 2 GiB: the tenant's context and chunks beside the held process's context and 100 MiB
        start_tenant(sim_env, a, "2Gi", 30, *work),
        start_tenant(sim_env, b, "2Gi", 50, *work),
    ]
    shim_env = dict(sim_env, LD_PRELOAD=str(shim_library()), CUDA_DEVICE_MEMORY_SHARED_CACHE=str(a))
    held = Held(build_c("shim_ops.c"), shim_env, "init", "ctx", f"alloc:{100 * MiB}")
    try:
        deadline = time.monotonic() + 40
        missing = []
        for title, expr in panel_queries():
            if not _eventually(prom, expr, deadline):
                missing.append(f"panel {title!r}: {expr}")
        for r in rules():
            name = r.get("record")
            if name and not _eventually(prom, name, deadline):
                missing.append(f"recording rule {name}")
        for var, selector, label in variable_queries():
            series = prom.api("series", **{"match[]": selector})
            if not any(s.get(label) for s in series):
                missing.append(f"variable {var}: no {label} in {selector}")
        assert not missing, "no series for:\n" + "\n".join(missing) + "\n" + prom.output()[-3000:]
    finally:
        held.release()
        for t in tenants:
            _, err = t.communicate(timeout=60)
            assert t.returncode == 0, err
    # the achieved shares reached Prometheus while the tenants ran: asked once both have run their
    # kernels (on a loaded machine every series can exist before either tenant's first launch)
    share = 'max_over_time(vgpu_slice_compute_used_ratio{job="vgpu-sharing"}[5m])'
    deadline = time.monotonic() + 30
    while True:
        used = prom.query(share)
        if (
            len(used) == 2 and all(float(s["value"][1]) > 0 for s in used)
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(used) == 2 and all(float(s["value"][1]) > 0 for s in used), used
    groups = prom.api("rules")["groups"]
    bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"]
           if r["health"] != "ok"]  # fmt: skip
    assert not bad, bad
    [up] = prom.query(f'up{{job="{JOB}"}}')
    assert up["value"][1] == "1"


def test_every_query_of_hamis_dashboard_returns_series(
    prometheus_setup: tuple[Prometheus, Path, Path], sim_env: dict[str, str]
) -> None:
    prom, a, b = prometheus_setup
    assert hami_dashboard()["commit"] and hami_dashboard()["source"].startswith("https://")
    work = ["--chunk-mib", "256", "--max-chunks", "4", "--seconds", "8"]
    tenants = [
        start_tenant(sim_env, a, "2Gi", 30, *work),
        start_tenant(sim_env, b, "2Gi", 50, *work),
    ]
    try:
        deadline = time.monotonic() + 40
        missing = [f"panel {t!r}: {q}" for t, q in hami_panel_queries()
                   if not _eventually(prom, q, deadline)]  # fmt: skip
        for var, selector, label in hami_variable_queries():
            series = prom.api("series", **{"match[]": selector})
            if not any(s.get(label) for s in series):
                missing.append(f"variable {var}: no {label} in {selector}")
        assert not missing, "no series for:\n" + "\n".join(missing) + "\n" + prom.output()[-3000:]
        # per container: the tenants' memory (each its own process here, in no container), under
        # their claims' namespaces, against their claims' quotas
        seen = "max by (namespace) (max_over_time(hami_vgpu_memory_used_bytes[5m]))"
        while len(used := prom.query(seen)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert {s["metric"]["namespace"] for s in used} == {"team-a", "team-b"}, used
        assert all(float(s["value"][1]) > 0 for s in used), used
        limits = {s["metric"]["namespace"]: float(s["value"][1]) for s in
                  prom.query("max by (namespace) (max_over_time(hami_vgpu_memory_limit_bytes[5m]))")}  # fmt: skip
        assert limits == {"team-a": 1 << 30, "team-b": 2 << 30}, limits
        [node] = {s["metric"]["node"] for s in prom.query("hami_gpu_memory_limit_bytes")}
        assert node == "node-1"
    finally:
        for t in tenants:
            _, err = t.communicate(timeout=60)
            assert t.returncode == 0, err

"""`vgpu demo`: serves the exporter while it runs, checks each tenant's share from both sides
(--seconds 0 fails), and --json for scripts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.observers import only, scrape

pytestmark = pytest.mark.slow

DEMO = [sys.executable, "-m", "sharing.cli", "demo"]


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DEMO, *args], env=env, capture_output=True, text=True, timeout=120)


def test_json_summary_and_shares_within_bounds(sim_env: dict[str, str]) -> None:
    # The default phase (6 s): shorter ones end before the cap's NVML loop has corrected what
    # the events charge beside a busy neighbour (docs/compute.md), so they judge less than the cap.
    r = _run(["--json", "--listen", "127.0.0.1:0"], sim_env)
    doc = json.loads(r.stdout)  # nothing but the JSON on stdout
    # The demo also fails a tenant that got well under its cap ("got only"): a loaded host that
    # cannot keep the device fed does that, so that judgement is the demo's, not this test's
    # (how close to its cap a tenant gets is measured in benchmarks/bench_compute.py).
    short = [f for f in doc["failures"] if ": got only " in f]
    assert r.returncode == (1 if short else 0), r.stdout + r.stderr
    assert doc["ok"] == (not short) and doc["failures"] == short, doc
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", doc["metrics_url"])
    by = {t["name"]: t for t in doc["tenants"]}
    assert by["team-a"]["memory_seen_bytes"] == 4 << 30 and by["team-a"]["granted_gib_chunks"] == 3
    assert by["team-a"]["context_bytes"] == CONTEXT_MEMORY  # 4 GiB: the context and 3 x 1 GiB
    assert by["team-b"]["next_allocation_refused"] is True
    for t in doc["tenants"]:
        cap = t["compute_cap_percent"]
        assert t["achieved_percent"] <= cap + 3, t  # the cap held
        assert t["charged_percent"] > 0, t


def test_no_compute_phase_does_not_pass(sim_env: dict[str, str]) -> None:
    r = _run(["--seconds", "0", "--json", "--listen", "127.0.0.1:0"], sim_env)
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False
    assert any("team-a: got only 0.0% with a 30% cap" in f for f in doc["failures"]), doc


def test_bad_arguments_get_one_line(sim_env: dict[str, str]) -> None:
    for args, msg in ((["--seconds", "-1"], "--seconds -1: must be 0 or more"),
                      (["--listen", "nope"], "expected HOST:PORT")):  # fmt: skip
        r = _run(args, sim_env)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_serves_the_exporter_while_it_runs(sim_env: dict[str, str], tmp_path: Path) -> None:
    p = subprocess.Popen(
        [*DEMO, "--listen", "127.0.0.1:0"],  # the default phase: see the first test
        env=sim_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None
    url = None
    for line in p.stdout:
        m = re.match(r"metrics: (http://\S+)/metrics", line)
        if m:
            url = m.group(1)
            break
    assert url, "the demo did not print its metrics URL"
    s = scrape(url)
    claims = sorted(Path(x.labels["claim"]).name for x in only(s, "vgpu_slice_memory_limit_bytes"))
    assert claims == ["team-a.region", "team-b.region"]
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    assert "got its share" in out and "vgpu top" in out  # the live view was drawn

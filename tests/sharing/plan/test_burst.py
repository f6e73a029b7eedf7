"""`vgpu plan` and bursting (docs/policy.md, "Memory that bursts and is given back"): placement
counts requests only; what a VgpuConfig memoryLimit could add is reported per device, bounded
by the memory the plan leaves free there (the pool bursting claims borrow from)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sharing.cli.main import main
from tests.sharing.plan.build import (
    DRIVER,
    gpu,
    placements,
    request,
    resource_slice,
    run_plan,
    workload,
    write_inputs,
)

SLICES = [resource_slice("node-a", [gpu("gpu-0", "40Gi"), gpu("gpu-1", "40Gi")])]


def bursting(name: str, replicas: int, memory: str, limit: Any) -> dict[str, Any]:
    w = workload(name, replicas, [request(capacity={"memory": memory, "cores": "10"})])
    w["spec"]["devices"]["config"] = [{"opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", "memoryLimit": limit}}}]  # fmt: skip
    return w


def test_placement_counts_requests_and_the_report_says_what_bursting_could_add(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 3 x 10Gi with a limit of 2x: 30Gi on gpu-0 (the limit is not placed), 10Gi left free there
    code, doc = run_plan(tmp_path, SLICES, [bursting("infer", 3, "10Gi", "2x")], capsys)
    assert code == 0
    assert [p[3] for p in placements(doc)] == ["gpu-0"] * 3
    assert doc["burst"] == [{"node": "node-a", "device": "gpu-0", "headroom": "30Gi",
                             "pool": "10Gi", "could_add": "10Gi"}]  # fmt: skip
    # a limit in bytes; a device with no bursting claim is not listed
    code, doc = run_plan(tmp_path, SLICES, [bursting("big", 1, "8Gi", "12Gi")], capsys)
    assert doc["burst"] == [{"node": "node-a", "device": "gpu-0", "headroom": "4Gi",
                             "pool": "32Gi", "could_add": "4Gi"}]  # fmt: skip


def test_no_bursting_workload_no_burst_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = workload("plain", 1, [request(capacity={"memory": "10Gi", "cores": "10"})])
    code, doc = run_plan(tmp_path, SLICES, [w], capsys)
    assert code == 0 and "burst" not in doc
    s, wl = write_inputs(tmp_path, SLICES, [w])
    assert main(["plan", "--slices", str(s), "--workloads", str(wl)]) == 0
    assert "BURST" not in capsys.readouterr().out


def test_the_text_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s, w = write_inputs(tmp_path, SLICES, [bursting("infer", 3, "10Gi", "2x")])
    assert main(["plan", "--slices", str(s), "--workloads", str(w)]) == 0
    out = capsys.readouterr().out
    section = out.split("BURST (the plan counts requests only; what memoryLimit could add)\n")[1]
    assert section.splitlines()[:2] == [
        "NODE    DEVICE  HEADROOM  POOL  COULD ADD",
        "node-a  gpu-0   30Gi      10Gi  10Gi",
    ], out


@pytest.mark.parametrize(
    ("limit", "message"),
    [("0.5x", "'0.5x' is below the request; allowed: 1x or more"),
     ("lots", "'lots' is not a quantity"), (True, "True invalid; allowed: a quantity, or <r>x")],
)  # fmt: skip
def test_a_bad_memory_limit_is_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], limit: Any, message: str
) -> None:
    s, w = write_inputs(tmp_path, SLICES, [bursting("infer", 1, "10Gi", limit)])
    assert main(["plan", "--slices", str(s), "--workloads", str(w)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert "workloads[0].spec.devices.config[0].opaque.parameters.memoryLimit" in err, err

"""Bad input: exit 2 and one line naming the file and the field; accepted input forms."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharing.cli.main import main
from tests.sharing.plan.build import CLASS, gpu, request, resource_slice, workload, write_inputs

GOOD = [resource_slice("node-a", [gpu("gpu-0")])]


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def _plan(s: Path, w: Path) -> list[str]:
    return ["plan", "--slices", str(s), "--workloads", str(w)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mutate", "field", "what"),
    [
        (
            lambda w: w[0]["spec"]["devices"]["requests"][0]["exactly"].update(
                capacity={"requests": {"memory": "lots"}}
            ),
            "workloads[0].spec.devices.requests[0].exactly.capacity.requests.memory",
            "is not a quantity",
        ),
        (
            lambda w: w[0]["spec"]["devices"]["requests"][0]["exactly"].update(
                deviceClassName="nope"
            ),
            "workloads[0].spec.devices.requests[0].exactly.deviceClassName",
            "DeviceClass 'nope' not found",
        ),
        (lambda w: w[0].update(replicas=-1), "workloads[0].replicas", "must be an integer >= 0"),
        (
            lambda w: w[0]["spec"]["devices"]["requests"][0]["exactly"].update(
                allocationMode="Some"
            ),
            "workloads[0].spec.devices.requests[0].exactly.allocationMode",
            "allowed: ExactCount, All",
        ),
        (
            lambda w: w[0]["spec"]["devices"].update(constraints=[{"matchAttribute": "pcieRoot"}]),
            "workloads[0].spec.devices.constraints[0].matchAttribute",
            "must be fully qualified",
        ),
        (
            lambda w: w[0]["spec"]["devices"].update(
                constraints=[{"requests": ["x"], "matchAttribute": "a/b"}]
            ),
            "workloads[0].spec.devices.constraints[0].requests",
            "'x' is not a request",
        ),
        (lambda w: w.append(dict(w[0])), "workloads[1].name", "used by an earlier workload"),
        # A misspelled field is an error naming it and what is allowed, never a silent default
        # (one replica, the whole device).
        (
            lambda w: w[0].update(replica=3),
            "workloads[0].replica",
            "unknown field; allowed: name, replicas, spec",
        ),
        (
            lambda w: w[0]["spec"]["devices"]["requests"][0]["exactly"].update(
                capcity={"requests": {"memory": "1Gi"}}
            ),
            "workloads[0].spec.devices.requests[0].exactly.capcity",
            "unknown field; allowed: name, deviceClassName, selectors, allocationMode, count,",
        ),
        (
            lambda w: w[0]["spec"]["devices"]["requests"][0]["exactly"]["capacity"].update(
                request={"cores": "10"}
            ),
            "workloads[0].spec.devices.requests[0].exactly.capacity.request",
            "unknown field; allowed: requests",
        ),
        (
            lambda w: w[0]["spec"]["devices"]["requests"][0]["exactly"].update(
                selectors=[{"cel": {"expresion": "true"}}]
            ),
            "workloads[0].spec.devices.requests[0].exactly.selectors[0].cel.expresion",
            "unknown field; allowed: expression",
        ),
    ],
)
def test_bad_workloads_name_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate: Any, field: str, what: str
) -> None:
    ws = [workload("w", 1, [request(capacity={"memory": "1Gi"})])]
    mutate(ws)
    s, w = write_inputs(tmp_path, GOOD, ws)
    err = _err(capsys, _plan(s, w))
    assert err.startswith(f"vgpu plan: {w}: {field}: "), err
    assert what in err


def test_unknown_top_level_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s, w = write_inputs(tmp_path, GOOD, [workload("w", 1, [request()])])
    doc = yaml.safe_load(w.read_text())
    doc["workload"] = doc.pop("workloads")
    w.write_text(yaml.safe_dump(doc))
    assert _err(capsys, _plan(s, w)) == (
        f"vgpu plan: {w}: workload: unknown field; allowed: workloads, deviceClasses"
    )


def test_bad_slice_names_file_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dev = gpu("gpu-0", memory_policy={"validRange": {"max": "4Gi"}})
    s, w = write_inputs(
        tmp_path, [resource_slice("node-a", [dev])], [workload("w", 1, [request()])]
    )
    err = _err(capsys, _plan(s, w))
    assert err == (
        f"vgpu plan: {s}: items[1].spec.devices[0].capacity.memory.requestPolicy.validRange.min: is required"
    )


def test_not_yaml_and_missing_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s, w = write_inputs(tmp_path, GOOD, [workload("w", 1, [request()])])
    bad = tmp_path / "bad.yaml"
    bad.write_text("workloads: [\n")
    assert "not YAML or JSON" in _err(capsys, _plan(s, bad))
    assert "no such file or directory" in _err(capsys, _plan(tmp_path / "none", w))
    other = tmp_path / "pod.yaml"
    other.write_text(yaml.safe_dump({"kind": "Pod"}))
    assert _err(capsys, _plan(other, w)) == (
        f"vgpu plan: {other}: kind: 'Pod' is not allowed; allowed: ResourceSlice, DeviceClass, "
        "ResourceClaim"
    )


def test_json_and_directory_inputs_and_classes_in_the_workloads_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "slices"
    d.mkdir()
    (d / "one.json").write_text(json.dumps(GOOD[0]))
    (d / "two.yaml").write_text(yaml.safe_dump_all([resource_slice("node-b", [gpu("gpu-0")])]))
    (d / "notes.txt").write_text("ignored")
    w = tmp_path / "w.json"
    w.write_text(
        json.dumps({"workloads": [workload("w", 2, [request()])], "deviceClasses": [CLASS]})
    )
    assert main(_plan(d, w)) == 0
    out = capsys.readouterr().out
    assert "node-a  gpu-0   gpu      cores=100 memory=40Gi" in out
    assert "node-b  gpu-0   gpu      cores=100 memory=40Gi" in out


@pytest.mark.slow
def test_exit_codes_of_the_console_script(tmp_path: Path) -> None:
    s, w = write_inputs(tmp_path, GOOD, [workload("w", 1, [request()])])
    vgpu = str(Path(sys.executable).parent / "vgpu")
    ok = subprocess.run([vgpu, *_plan(s, w)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    s2, w2 = write_inputs(tmp_path, GOOD, [workload("w", 2, [request()])])
    short = subprocess.run([vgpu, *_plan(s2, w2)], capture_output=True, text=True, timeout=60)
    assert short.returncode == 1
    assert "NOT PLACED (1 replicas)" in short.stdout
    bad = subprocess.run(
        [vgpu, *_plan(s2, tmp_path / "missing.yaml")], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2


def test_a_bad_class_selector_names_the_file_of_the_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad_class = {**CLASS, "spec": {"selectors": [{"cel": {"expression": "device.driver =="}}]}}
    s, w = write_inputs(tmp_path, GOOD, [workload("w", 1, [request()])])
    classes = tmp_path / "classes.yaml"
    classes.write_text(yaml.safe_dump(bad_class))
    err = _err(
        capsys, ["plan", "--slices", str(s), "--slices", str(classes), "--workloads", str(w)]
    )
    assert err.startswith(f"vgpu plan: {classes}: spec.selectors[0].cel.expression: CEL expression")


def test_json_output_has_exactly_the_documented_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, w = write_inputs(tmp_path, GOOD, [workload("w", 2, [request()])])
    assert main([*_plan(s, w), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"placed", "unplaced", "devices"}
    assert [set(p) for p in doc["placed"]] == [
        {"workload", "replica", "node", "device", "consumed"}
    ]
    assert [set(u) for u in doc["unplaced"]] == [{"workload", "replica", "reason"}]
    assert [set(d) for d in doc["devices"]] == [{"node", "device", "free"}]
    assert doc["placed"][0]["replica"] == 0 and doc["unplaced"][0]["replica"] == 1

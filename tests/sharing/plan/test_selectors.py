"""CEL selectors on attributes and capacity, through the CEL library, with Kubernetes'
quantity and semver functions."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from sharing.plan.cel_eval import CelError, SelectorEvaluator
from sharing.plan.model import Capacity, Device
from tests.sharing.plan.build import (
    DRIVER,
    gpu,
    placements,
    request,
    resource_slice,
    run_plan,
    workload,
)

A100 = gpu("gpu-0", "40Gi", product="NVIDIA A100-SXM4-40GB", cc="8.0.0")
H100 = gpu("gpu-0", "80Gi", product="NVIDIA H100 80GB HBM3", cc="9.0.0")
SLICES = [resource_slice("node-a", [A100]), resource_slice("node-b", [H100])]


@pytest.mark.parametrize(
    ("expression", "node"),
    [
        (f'device.attributes["{DRIVER}"].productName.startsWith("NVIDIA H100")', "node-b"),
        (f'device.capacity["{DRIVER}"].memory.compareTo(quantity("64Gi")) >= 0', "node-b"),
        (f'device.capacity["{DRIVER}"].memory.isLessThan(quantity("64Gi"))', "node-a"),
        (
            f'device.attributes["{DRIVER}"].cudaComputeCapability.isGreaterThan(semver("8.0.0"))',
            "node-b",
        ),
        (f'device.attributes["{DRIVER}"].cudaComputeCapability.major() == 8', "node-a"),
        (f'device.capacity["{DRIVER}"].memory == quantity("40Gi")', "node-a"),
    ],
)
def test_selector_picks_the_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], expression: str, node: str
) -> None:
    code, doc = run_plan(
        tmp_path, SLICES, [workload("w", 1, [request(selectors=[expression])])], capsys
    )
    assert code == 0
    assert placements(doc)[0][2] == node


def test_no_device_matches_names_the_selector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expr = f'device.capacity["{DRIVER}"].memory.isGreaterThan(quantity("100Gi"))'
    code, doc = run_plan(tmp_path, SLICES, [workload("w", 2, [request(selectors=[expr])])], capsys)
    assert code == 1
    assert [u["replica"] for u in doc["unplaced"]] == [0, 1]
    assert doc["unplaced"][0]["reason"] == (
        "request gpu: no device can serve it (2 device(s): selector #0 is false)"
    )


def test_a_runtime_error_is_reported_and_the_device_does_not_match(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expr = f'device.attributes["{DRIVER}"].noSuchAttribute == 1'
    code, doc = run_plan(tmp_path, SLICES, [workload("w", 1, [request(selectors=[expr])])], capsys)
    assert code == 1
    assert "CEL runtime error" in doc["unplaced"][0]["reason"]
    assert "noSuchAttribute" in doc["unplaced"][0]["reason"]


def _device(uuid: str, memory: int) -> Device:
    return Device(
        "n",
        DRIVER,
        "n",
        uuid,
        {f"{DRIVER}/uuid": ("string", uuid), f"{DRIVER}/productName": ("string", "X")},
        {f"{DRIVER}/memory": Capacity("memory", Decimal(memory), None)},
        True,
    )


def test_identical_devices_cost_one_evaluation_unless_the_expression_reads_what_differs() -> None:
    ev = SelectorEvaluator()
    by_product = ev.compile(f'device.attributes["{DRIVER}"].productName == "X"')
    by_uuid = ev.compile(f'device.attributes["{DRIVER}"].uuid == "GPU-1"')
    devices = [_device(f"GPU-{i}", 1024) for i in range(5)]
    for d in devices:
        d.index = int(d.name[4:])
    assert [ev.matches(by_product, d) for d in devices] == [True] * 5
    assert ev.evaluations == 1
    assert [ev.matches(by_uuid, d) for d in devices] == [False, True, False, False, False]
    assert ev.evaluations == 6
    # A macro over the map may read any key: no sharing of results.
    ev2 = SelectorEvaluator()
    any_one = ev2.compile(f'device.attributes["{DRIVER}"].exists(k, k == "uuid")')
    assert [ev2.matches(any_one, d) for d in devices] == [True] * 5
    assert ev2.evaluations == 5
    # So does a computed key: "uu" + "id" names uuid without mentioning it.
    computed = ev2.compile(f'device.attributes["{DRIVER}"]["uu" + "id"] == "GPU-3"')
    assert [ev2.matches(computed, d) for d in devices] == [False, False, False, True, False]


def test_quantity_functions_have_kubernetes_semantics() -> None:
    ev = SelectorEvaluator()
    d = _device("GPU-0", 1024**3)
    for expr, want in [
        ('quantity("1Gi") == quantity("1024Mi")', True),
        ('quantity("1G").isLessThan(quantity("1Gi"))', True),
        ('quantity("500m").add(quantity("500m")) == quantity("1")', True),
        ('quantity("2").sub(1).asInteger() == 1', True),
        ('quantity("1.5").isInteger()', False),
        ('quantity("-3").sign() == -1', True),
        ('isQuantity("4Gi") && !isQuantity("four")', True),
        ('semver("1.10.0").isGreaterThan(semver("1.9.0"))', True),
        ('semver("1.0.0-rc.1").isLessThan(semver("1.0.0"))', True),
        ('semver("v1.2", true).minor() == 2', True),
    ]:
        assert ev.matches(ev.compile(expr), d) is want, expr


def test_a_selector_that_does_not_compile_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(CelError):
        SelectorEvaluator().compile("device.driver ==")
    from sharing.cli.main import main
    from tests.sharing.plan.build import write_inputs

    s, w = write_inputs(
        tmp_path, SLICES, [workload("w", 1, [request(selectors=["device.driver =="])])]
    )
    assert main(["plan", "--slices", str(s), "--workloads", str(w)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"vgpu plan: {w}: workloads[0].spec.devices.requests[0].exactly.selectors[0].cel.expression: CEL expression does not compile"
    )
    assert "\n" not in err


def test_runtime_errors_say_what_went_wrong() -> None:
    ev = SelectorEvaluator()
    d = _device("GPU-0", 1)
    assert ev.matches(ev.compile('quantity("abc") == quantity("1")'), d) == (
        "CEL runtime error: return error for overflow: 'abc' is not a quantity; allowed: a Kubernetes quantity (e.g. 4Gi, 512Mi, 4G, 1500k, 1e9) below 2^64"
    )
    assert ev.matches(ev.compile("1/0 == 1"), d) == (
        "CEL runtime error: modulus or divide by zero: integer division or modulo by zero"
    )
    assert ev.matches(ev.compile('"a"'), d) == "the expression gave StringType, not a bool"


def test_a_domain_the_device_lacks_reads_as_an_empty_map() -> None:
    """As in Kubernetes: guards with `in` / has() work on other drivers' domains."""
    ev = SelectorEvaluator()
    d = _device("GPU-0", 1)
    assert ev.matches(ev.compile('"x" in device.attributes["other.io"]'), d) is False
    assert ev.matches(ev.compile('has(device.attributes["other.io"].x)'), d) is False
    assert ev.matches(ev.compile('size(device.capacity["other.io"]) == 0'), d) is True
    err = ev.matches(ev.compile('device.attributes["other.io"].x == 1'), d)
    assert isinstance(err, str) and "no such member" in err


def test_kubernetes_string_functions_and_short_errors() -> None:
    ev = SelectorEvaluator()
    d = _device("GPU-0", 1)
    for expr in [
        'device.attributes["vgpu.sharing.dev"].productName.lowerAscii() == "x"',
        '"a,b,c".split(",").size() == 3 && ["a", "b"].join("-") == "a-b"',
        '" x ".trim() == "x" && "abc".indexOf("c") == 2 && "aaa".replace("a", "b") == "bbb"',
    ]:
        assert ev.matches(ev.compile(expr), d) is True, expr
    # Not available (cel.bind is a cel-go macro celpy lacks): one short line, not the activation.
    err = ev.matches(ev.compile('cel.bind(a, device.driver, a == "x")'), d)
    assert err == "CEL runtime error: undeclared reference to 'bind'"

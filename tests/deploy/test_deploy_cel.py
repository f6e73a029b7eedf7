"""The DeviceClasses' and examples' CEL selectors, compiled and evaluated with a real CEL library
(cel-python) on the devices the real plugin publishes from the simulated GPUs (one H100, one
A100; the shipped policy, plus an override leaving the A100 whole in partition mode): each
request selects exactly the devices it is meant to. Also: the examples' capacity requests are
valid amounts under the shipped policy and fit the published devices."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharing.kubequantity import parse_bytes
from sharing.plan.cel_eval import SelectorEvaluator
from sharing.plan.loader import load_slices
from sharing.plan.model import Device
from sharing.policy import from_document
from tests.fakes.apiserver import FakeApiServer, parse_quantity
from tests.sharing.plan.build import resource_slice
from tests.support.deploy_tree import DEPLOY, examples, of_kind
from tests.support.plugin_e2e import (
    DRIVER,
    PluginProcess,
    device,
    devices_of,
    sim_ready,  # noqa: F401 - fixture
    wait_names,
    write_config,
)

pytestmark = pytest.mark.slow

A100 = {"name": "NVIDIA A100-SXM4-40GB", "memory": "40Gi"}
SHARING = ["gpu-0", "gpu-1"]
PARTITION = ["gpu-0-slice-0", "gpu-0-slice-1", "gpu-0-slice-2", "gpu-0-slice-3", "gpu-1-slice-0"]

# What each example request is meant to select (other drivers' requests, e.g. the NIC, are not
# ours to evaluate).
INTENDED = {
    "sharing/share-4gi-25pct.yaml": SHARING,
    "sharing/two-containers-one-claim.yaml": SHARING,
    "sharing/two-gpus.yaml": SHARING,
    "sharing/vgpuconfig-elastic.yaml": SHARING,
    "sharing/gpu-and-nic.yaml": SHARING,
    "sharing/whole-gpu.yaml": SHARING,
    "sharing/refused-past-quota.yaml": SHARING,
    "burst/pod.yaml": SHARING,  # bursting is sharing mode's alone
    "partition/one-slice.yaml": PARTITION,
    "partition/two-containers-one-claim.yaml": PARTITION,
    "partition/two-gpus.yaml": ["gpu-0-slice-0", "gpu-1-slice-0"],
    "partition/vgpuconfig-elastic.yaml": PARTITION,
    "partition/gpu-and-nic.yaml": PARTITION,
    "partition/whole-gpu.yaml": ["gpu-1-slice-0"],
    "partition/refused-past-quota.yaml": PARTITION,
}


def shipped_policy() -> dict[str, Any]:
    [cm] = of_kind("base", "ConfigMap")
    doc: dict[str, Any] = yaml.safe_load(cm["data"]["policy.yaml"])
    return doc


def publish(root: Path, mode: str) -> dict[str, dict[str, Any]]:
    """The devices the plugin publishes from the simulator in this mode."""
    policy = shipped_policy()
    if mode == "partition":
        policy["overrides"] = [{"match": {"modelName": "NVIDIA A100*"}, "partitions": 1}]
    (root / "policy.yaml").write_text(yaml.safe_dump(policy))
    write_config(root / "simgpu.json", [device(0), device(1) | A100])
    with FakeApiServer(drop_consumable_capacity=mode == "partition") as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}})
        p = PluginProcess(server, root, "--policy", str(root / "policy.yaml"))
        try:
            wait_names(server, p, SHARING if mode == "sharing" else PARTITION)
            return devices_of(server)
        finally:
            assert p.terminate() == 0, p.output()


@pytest.fixture(scope="module")
def published(sim_ready: None) -> Iterator[dict[str, dict[str, dict[str, Any]]]]:  # noqa: F811
    import shutil

    out = {}
    for mode in ("sharing", "partition"):
        d = Path(tempfile.mkdtemp(prefix="vgpu-cel-", dir="/tmp"))
        try:
            out[mode] = publish(d, mode)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    yield out


EVALUATOR = SelectorEvaluator()  # `vgpu plan`'s CEL evaluator


def as_device(driver: str, device: dict[str, Any]) -> Device:
    """A published device as `vgpu plan` reads it (from a ResourceSlice of the given driver)."""
    doc = resource_slice("node-a", [device])
    doc["spec"]["driver"] = driver
    with tempfile.TemporaryDirectory(prefix="vgpu-cel-") as d:
        path = Path(d) / "slice.yaml"
        path.write_text(yaml.safe_dump(doc))
        inventory, _ = load_slices(path)
    [dev] = [d for devs in inventory.nodes.values() for d in devs]
    return dev


def selects(expressions: list[str], driver: str, device: dict[str, Any]) -> bool:
    """True if every expression is true for the device (an evaluation error is not a match, as
    the scheduler treats it for this device)."""
    dev = as_device(driver, device)
    return all(EVALUATOR.matches(EVALUATOR.compile(e), dev) is True for e in expressions)


def class_expressions() -> dict[str, list[str]]:
    return {
        d["metadata"]["name"]: [s["cel"]["expression"] for s in d["spec"]["selectors"]]
        for d in of_kind("base", "DeviceClass")
    }


def request_expressions(req: dict[str, Any]) -> list[str]:
    exactly = req["exactly"]
    return class_expressions()[exactly["deviceClassName"]] + [
        s["cel"]["expression"] for s in exactly.get("selectors") or []
    ]


def our_requests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for where, doc in examples():
        if doc["kind"] != "ResourceClaimTemplate":
            continue
        for req in doc["spec"]["spec"]["devices"]["requests"]:
            if req["exactly"]["deviceClassName"] in class_expressions():
                out.append((where.split("#")[0].removeprefix("examples/"), req))
    return out


def test_every_expression_compiles() -> None:
    exprs = [e for es in class_expressions().values() for e in es]
    exprs += [e for _, r in our_requests() for e in request_expressions(r)]
    assert len(exprs) > 12
    for e in exprs:
        EVALUATOR.compile(e)  # raises CelError on a syntax error


def test_every_example_is_covered() -> None:
    assert sorted({w for w, _ in our_requests()}) == sorted(INTENDED)


@pytest.mark.parametrize("mode", ["sharing", "partition"])
def test_device_classes_select_the_intended_devices(
    published: dict[str, dict[str, dict[str, Any]]], mode: str
) -> None:
    devs = published[mode]
    classes = class_expressions()
    chosen = {
        name: sorted(d for d, dev in devs.items() if selects(exprs, DRIVER, dev))
        for name, exprs in classes.items()
    }
    assert chosen["vgpu.sharing.dev"] == sorted(devs)
    assert chosen["vgpu-whole.sharing.dev"] == (SHARING if mode == "sharing" else ["gpu-1-slice-0"])
    # Another driver's device is never selected.
    assert not selects(classes["vgpu.sharing.dev"], "other.example.com", devs[sorted(devs)[0]])


@pytest.mark.parametrize(("where", "req"), our_requests(), ids=[w for w, _ in our_requests()])
def test_example_request_selects_the_intended_devices(
    published: dict[str, dict[str, dict[str, Any]]], where: str, req: dict[str, Any]
) -> None:
    mode = where.split("/")[0].replace("burst", "sharing")
    devs = published[mode]
    exprs = request_expressions(req)
    got = sorted(d for d, dev in devs.items() if selects(exprs, DRIVER, dev))
    assert got == INTENDED[where]
    caps = (req["exactly"].get("capacity") or {}).get("requests") or {}
    if mode == "partition":
        assert not caps, "partition mode has no consumable capacity to request"
        return
    rules = from_document(shipped_policy()).default
    for name in got:
        capacity = devs[name]["capacity"]
        if "memory" in caps:
            mem = parse_bytes(caps["memory"])
            assert mem >= rules.memory.min and (mem - rules.memory.min) % rules.memory.step == 0
            assert mem <= parse_quantity(capacity["memory"]["requestPolicy"]["validRange"]["max"])
        cores = int(caps.get("cores", capacity["cores"]["requestPolicy"]["default"]))
        assert cores >= rules.cores.min and (cores - rules.cores.min) % rules.cores.step == 0
        assert "sharers" not in caps  # every allocation consumes exactly the default, 1


def test_whole_gpu_example_holds_all_cores() -> None:
    [req] = [r for w, r in our_requests() if w == "sharing/whole-gpu.yaml"]
    assert req["exactly"]["capacity"]["requests"]["cores"] == "100"
    assert (DEPLOY / "examples" / "sharing" / "whole-gpu.yaml").exists()

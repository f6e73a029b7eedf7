"""docs/plan.md's worked example: the shipped files give exactly the output the doc shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sharing.cli.main import main

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "docs" / "examples" / "plan"
ARGS = ["plan", "--slices", str(EXAMPLE / "slices"), "--workloads", str(EXAMPLE / "workloads.yaml")]


def _doc_block(marker: str, fence: str) -> str:
    text = (REPO / "docs" / "plan.md").read_text()
    m = re.search(re.escape(marker) + r".*?" + re.escape(fence) + r"\n(.*?)\n```", text, re.S)
    assert m, f"no {fence} block after {marker!r} in docs/plan.md"
    return m.group(1)


def test_text_output_is_what_the_doc_shows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARGS) == 1
    shown = _doc_block("<!-- plan-example-output", "```")
    assert capsys.readouterr().out.rstrip("\n") == shown


def test_json_excerpt_is_part_of_the_real_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    excerpt = json.loads(_doc_block("--json` gives the same as data", "```json"))
    for key in ("placed", "unplaced", "devices"):
        for item in excerpt[key]:
            assert item in got[key], (key, item)


def test_example_device_classes_are_the_deployed_ones() -> None:
    """The example carries the DeviceClasses deploy/ installs (wherever they live there; an
    overlay's patch of one, which has no selectors of its own, is not a class)."""
    import yaml

    deployed = {
        d["metadata"]["name"]: d["spec"]["selectors"]
        for path in (REPO / "deploy").rglob("*.yaml")
        for d in yaml.safe_load_all(path.read_text())
        if isinstance(d, dict) and d.get("kind") == "DeviceClass" and "selectors" in d["spec"]
    }
    example = yaml.safe_load((EXAMPLE / "workloads.yaml").read_text())["deviceClasses"]
    assert deployed, "no DeviceClass under deploy/"
    assert {c["metadata"]["name"]: c["spec"]["selectors"] for c in example} == deployed


GiB = 1024**3
# node -> (mode, [(product, GiB, compute capability)]), as the example files were made.
EXAMPLE_NODES: dict[str, tuple[str, list[tuple[str, int, str]]]] = {
    "node-a": ("sharing", [("NVIDIA A100-SXM4-40GB", 40, "8.0")] * 2),
    "node-b": ("sharing", [("NVIDIA H100 80GB HBM3", 80, "9.0")]),
    "node-c": ("partition", [("NVIDIA A100-SXM4-40GB", 40, "8.0")]),
}
DESCRIPTION = {"node-a": "two A100 40GB", "node-b": "one H100 80GB", "node-c": "one A100 40GB"}


def example_slices(node: str) -> str:
    """The text of docs/examples/plan/slices/<node>.yaml, from the plugin's slice code."""
    import yaml

    from driver.discovery import DiscoveredGpu, Inventory
    from driver.slicebuild import pool_slices
    from sharing.gpus import GpuInfo

    mode, gpus = EXAMPLE_NODES[node]
    found = []
    for i, (product, gib, cc) in enumerate(gpus):
        info = GpuInfo(
            index=i,
            uuid=f"GPU-{node[-1]}000000{i}-0000-0000-0000-000000000000",
            name=product,
            memory_total=gib * GiB,
            memory_used=0,
            pci_bus_id=f"00000000:{0x18 + i * 0x20:02X}:00.0",
            minor=i,
            numa_node=0,
            compute_capability=cc,
            driver_version="550.54.15",
            cuda_driver_version="12.4",
        )
        found.append(DiscoveredGpu(info=info, pcie_root=f"pci0000:{0x18 + i * 0x20:02x}"))
    items = pool_slices(Inventory(tuple(found)), mode, 4, "vgpu.sharing.dev", node, 1)  # type: ignore[arg-type]
    doc = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}, "items": items}
    flags = " --sharing-mode partition" if mode == "partition" else ""
    return (
        f"# What `vgpu-kubelet-plugin --dry-run --node-name {node}{flags}` prints on a node with "
        f"{DESCRIPTION[node]}\n# (the plugin's own slice code, for made-up GPUs: "
        "tests/sharing/plan/test_worked_example.py checks it).\n"
        + yaml.safe_dump(doc, sort_keys=False)
    )


@pytest.mark.parametrize("node", sorted(EXAMPLE_NODES))
def test_example_slices_are_what_the_plugin_builds(node: str) -> None:
    """Guards against drift: when the plugin's slices change, rewrite the files with
    `.venv/bin/python -m tests.sharing.plan.test_worked_example` and update docs/plan.md."""
    assert (EXAMPLE / "slices" / f"{node}.yaml").read_text() == example_slices(node)


if __name__ == "__main__":
    for n in EXAMPLE_NODES:
        (EXAMPLE / "slices" / f"{n}.yaml").write_text(example_slices(n))

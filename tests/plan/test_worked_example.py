"""docs/plan.md's worked example: the shipped files give exactly the output the doc shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sharing.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "examples" / "plan"
ARGS = [
    "plan",
    "--slices",
    str(EXAMPLE / "slices"),
    "--slices",
    str(REPO / "deploy" / "base" / "deviceclasses.yaml"),
    "--workloads",
    str(EXAMPLE / "workloads.yaml"),
]


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


def test_example_slices_are_what_the_plugin_builds() -> None:
    """The example files are the plugin's own slice objects (guards against drift)."""
    import yaml

    from driver.discovery import DiscoveredGpu, Inventory
    from driver.resourceslices import pool_slices
    from sharing.gpus import GpuInfo

    doc = yaml.safe_load((EXAMPLE / "slices" / "node-b.yaml").read_text())
    dev = doc["items"][0]["spec"]["devices"][0]
    info = GpuInfo(
        index=0,
        uuid=dev["attributes"]["uuid"]["string"],
        name=dev["attributes"]["productName"]["string"],
        memory_total=80 * 1024**3,
        memory_used=0,
        pci_bus_id="00000000:18:00.0",
        minor=0,
        numa_node=0,
        compute_capability="9.0",
        driver_version="550.54.15",
        cuda_driver_version="12.4",
    )
    inv = Inventory((DiscoveredGpu(info=info, pcie_root="pci0000:18"),))
    assert pool_slices(inv, "sharing", 4, "vgpu.sharing.dev", "node-b", 1) == doc["items"]

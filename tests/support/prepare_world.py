"""A plugin in this process with its real gRPC sockets, a fake API server and a kubelet stand-in:
the world the prepare tests claim, prepare and unprepare in."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from driver.claims import RulesFor
from driver.reclaim import NvmlRead
from sharing.gpus import GpuInfo
from tests.driver.kubelet_standin import (
    DRIVER,
    ClaimId,
    KubeletStandin,
    allocated_claim,
    claim_id,
)
from tests.driver.plugin_process import InProcessPlugin
from tests.fakes.apiserver import FakeApiServer


@dataclass
class World:
    server: FakeApiServer
    plugin: InProcessPlugin
    kubelet: KubeletStandin
    root: Path

    def claim(self, name: str, **kw: Any) -> ClaimId:
        return claim_id(self.server.put(allocated_claim(name, **kw)))

    def spec_of(self, uid: str) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(
            (self.root / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json").read_text()
        )
        return doc

    def env_of(self, uid: str) -> dict[str, str]:
        edits = self.spec_of(uid)["devices"][0]["containerEdits"]
        return dict(e.split("=", 1) for e in edits["env"])


def make_world(
    mode: str = "sharing",
    partitions: int = 4,
    dev_nodes: tuple[str, ...] = (),
    rules_for: RulesFor | None = None,
    gpus: list[GpuInfo] | None = None,
    nvml: NvmlRead | None = None,
) -> Any:
    """A world; rules_for: the admin policy's rules of a GPU (default: the built-in policy);
    gpus: the plugin's GPUs (default: stand-ins); nvml: the host NVML a burst reclaim reads."""
    root = Path(tempfile.mkdtemp(prefix="vgp", dir="/tmp"))  # unix socket paths are short
    for n in dev_nodes:
        (root / "dev").mkdir(exist_ok=True)
        (root / "dev" / n).touch()
    server = FakeApiServer()
    server.up()
    plugin = InProcessPlugin(
        root, server.api_client(), gpus=gpus, mode=mode, partitions=partitions,
        rules_for=rules_for, nvml=nvml,
    )  # fmt: skip
    plugin.driver.start()
    kubelet = KubeletStandin(plugin.registration_socket)
    kubelet.register()
    return World(server, plugin, kubelet, root)


def close_world(w: World) -> None:
    w.kubelet.close()
    w.plugin.driver.stop()
    w.server.down()
    shutil.rmtree(w.root, ignore_errors=True)


@pytest.fixture
def world() -> Iterator[World]:
    w = make_world()
    yield w
    close_world(w)

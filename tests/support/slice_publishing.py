"""A SlicePublisher of one node against the fake API server, and the ResourceSlices and devices
it published there."""

from __future__ import annotations

from typing import Any

from driver.kube import Kube
from driver.slicepublisher import SlicePublisher
from tests.fakes.apiserver import FakeApiServer

DRIVER = "vgpu.sharing.dev"
NODE = "node-a"


def publisher(server: FakeApiServer, mode: str = "auto", partitions: int = 4) -> SlicePublisher:
    return SlicePublisher(
        Kube(server.api_client()),
        driver_name=DRIVER,
        node_name=NODE,
        requested_mode=mode,
        partitions=partitions,
    )


def slices(server: FakeApiServer) -> list[dict[str, Any]]:
    return server.objects("ResourceSlice")


def all_devices(server: FakeApiServer) -> list[dict[str, Any]]:
    return [d for s in slices(server) for d in s["spec"]["devices"]]

"""The kubelet's side of the plugin's health stream (DRAResourceHealth NodeWatchResources) over
real gRPC: a watcher that reads one version's stream into a queue."""

from __future__ import annotations

import importlib
import queue
import threading
from pathlib import Path
from typing import Any

import grpc

POOL = "node-a"  # the pool (a node's name) every device of the stream is in


def _pb(name: str) -> Any:
    return importlib.import_module(f"driver.proto.{name}")


class Watcher:
    """A kubelet's stream of one version, read by a thread into a queue of messages."""

    def __init__(self, sock: Path, version: str) -> None:
        self.pb = _pb(f"health_{version}_pb2")
        self.channel = grpc.insecure_channel(f"unix://{sock}")
        stub = _pb(f"health_{version}_pb2_grpc").DRAResourceHealthStub(self.channel)
        self.stream = stub.NodeWatchResources(self.pb.NodeWatchResourcesRequest())
        self.got: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for msg in self.stream:
                self.got.put(msg)
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    def next(self) -> Any:
        return self.got.get(timeout=30)

    def view(self, msg: Any) -> dict[str, tuple[str, str]]:
        assert {d.device.pool_name for d in msg.devices} <= {POOL}
        return {
            d.device.device_name: (self.pb.HealthStatus.Name(d.health), d.message)
            for d in msg.devices
        }

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()
        self.thread.join(10)

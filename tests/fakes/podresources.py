"""A stand-in for the kubelet's PodResources API (v1.PodResourcesLister), speaking the real gRPC
protocol on a unix socket: List and Get answer the pods the test has put, each container with
its DRA claims and their CDI devices, as the kubelet reports them."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from sharing.observe.proto import podresources_v1_pb2 as pb
from sharing.observe.proto import podresources_v1_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Held:
    """One container holding one claim."""

    namespace: str
    pod: str
    container: str
    claim: str
    cdi_devices: tuple[str, ...]
    driver: str = "vgpu.sharing.dev"
    pool: str = "node-a"
    device: str = "gpu-0"


class PodResourcesStandin(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self._lock = threading.Lock()
        self._held: list[Held] = []
        self.lists = 0  # List calls answered
        self._server: Any = None

    def put(self, *held: Held) -> None:
        with self._lock:
            self._held = list(held)

    def _pods(self) -> list[Any]:
        with self._lock:
            held = list(self._held)
        pods: dict[tuple[str, str], dict[str, list[Held]]] = {}
        for h in held:
            pods.setdefault((h.namespace, h.pod), {}).setdefault(h.container, []).append(h)
        out = []
        for (ns, name), containers in pods.items():
            cs = [
                pb.ContainerResources(
                    name=c,
                    dynamic_resources=[
                        pb.DynamicResource(
                            claim_name=h.claim,
                            claim_namespace=h.namespace,
                            claim_resources=[
                                pb.ClaimResource(
                                    cdi_devices=[pb.CDIDevice(name=d) for d in h.cdi_devices],
                                    driver_name=h.driver,
                                    pool_name=h.pool,
                                    device_name=h.device,
                                )
                            ],
                        )
                        for h in hs
                    ],
                )
                for c, hs in containers.items()
            ]
            out.append(pb.PodResources(name=name, namespace=ns, containers=cs))
        return out

    def List(self, request: Any, context: Any) -> Any:
        with self._lock:
            self.lists += 1
        return pb.ListPodResourcesResponse(pod_resources=self._pods())

    def Get(self, request: Any, context: Any) -> Any:
        for p in self._pods():
            if (p.namespace, p.name) == (request.pod_namespace, request.pod_name):
                return pb.GetPodResourcesResponse(pod_resources=p)
        context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name}")

    def start(self) -> PodResourcesStandin:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None

    def __enter__(self) -> PodResourcesStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

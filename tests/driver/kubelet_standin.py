"""A stand-in for the kubelet's side of DRA, speaking the real gRPC protocol on unix sockets.

It does what the kubelet does with a DRA plugin: finds the registration socket, calls GetInfo,
checks the answer, connects to the advertised endpoint, calls NotifyRegistrationStatus, and then
prepares/unprepares claims (v1 or v1beta1) and watches device health.

Also here: `allocated_claim()`, a ResourceClaim as the scheduler leaves it (allocated, pinned to
a node), for the tests to store in the fake API server.
"""

from __future__ import annotations

import importlib
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

DRIVER = "vgpu.sharing.dev"
NODE = "node-a"
KIND = f"k8s.{DRIVER}/claim"


def _pb(name: str) -> Any:
    return importlib.import_module(f"driver.proto.{name}")


@dataclass(frozen=True)
class ClaimId:
    namespace: str
    name: str
    uid: str


@dataclass
class PreparedDevice:
    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str | None


@dataclass
class PrepareAnswer:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


# What the kubelet gives each call to a DRA plugin (defaultClientCallTimeout in
# pkg/kubelet/cm/dra/plugin, Kubernetes 1.34 and 1.37)
KUBELET_CALL_TIMEOUT = 45.0


class KubeletStandin:
    def __init__(self, registration_socket: Path, timeout: float = KUBELET_CALL_TIMEOUT) -> None:
        self.registration_socket = registration_socket
        self.timeout = timeout
        self.info: Any = None
        self._dra: grpc.Channel | None = None

    @staticmethod
    def wait_for_socket(path: Path, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"socket {path} did not appear within {timeout}s")
            time.sleep(0.05)

    def register(self, accept: bool = True, error: str = "") -> Any:
        """GetInfo + NotifyRegistrationStatus, as the kubelet's plugin watcher does."""
        self.wait_for_socket(self.registration_socket)
        reg = _pb("pluginregistration_pb2")
        with grpc.insecure_channel(f"unix://{self.registration_socket}") as ch:
            stub = _pb("pluginregistration_pb2_grpc").RegistrationStub(ch)
            info = stub.GetInfo(reg.InfoRequest(), timeout=self.timeout)
            if info.type != "DRAPlugin":
                raise AssertionError(f"plugin type {info.type!r}, the kubelet wants DRAPlugin")
            if not Path(info.endpoint).is_absolute():
                raise AssertionError(f"endpoint {info.endpoint!r} is not an absolute path")
            stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=accept, error=error),
                timeout=self.timeout,
            )
        self.info = info
        if accept:
            self.close()
            self._dra = grpc.insecure_channel(f"unix://{info.endpoint}")
        return info

    def close(self) -> None:
        if self._dra is not None:
            self._dra.close()
            self._dra = None

    def _channel(self) -> grpc.Channel:
        if self._dra is None:
            raise AssertionError("not registered: call register() first")
        return self._dra

    @staticmethod
    def _claims(pb: Any, claims: Sequence[ClaimId]) -> list[Any]:
        return [pb.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]

    def prepare(self, claims: Sequence[ClaimId], version: str = "v1") -> dict[str, PrepareAnswer]:
        pb = _pb(f"dra_{version}_pb2")
        stub = _pb(f"dra_{version}_pb2_grpc").DRAPluginStub(self._channel())
        resp = stub.NodePrepareResources(
            pb.NodePrepareResourcesRequest(claims=self._claims(pb, claims)), timeout=self.timeout
        )
        out: dict[str, PrepareAnswer] = {}
        for uid, r in resp.claims.items():
            devices = [
                PreparedDevice(
                    request_names=list(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=list(d.cdi_device_ids),
                    share_id=(d.share_id if version == "v1" and d.HasField("share_id") else None),
                )
                for d in r.devices
            ]
            out[uid] = PrepareAnswer(devices=devices, error=r.error)
        return out

    def unprepare(self, claims: Sequence[ClaimId], version: str = "v1") -> dict[str, str]:
        pb = _pb(f"dra_{version}_pb2")
        stub = _pb(f"dra_{version}_pb2_grpc").DRAPluginStub(self._channel())
        resp = stub.NodeUnprepareResources(
            pb.NodeUnprepareResourcesRequest(claims=self._claims(pb, claims)), timeout=self.timeout
        )
        return {uid: r.error for uid, r in resp.claims.items()}

    def watch_health(self, version: str = "v1alpha1") -> Iterator[dict[str, tuple[str, str]]]:
        """Each message as {device_name: (pool_name, "HEALTHY"|"UNHEALTHY"|"UNKNOWN")}."""
        pb = _pb(f"health_{version}_pb2")
        stub = _pb(f"health_{version}_pb2_grpc").DRAResourceHealthStub(self._channel())
        stream = stub.NodeWatchResources(pb.NodeWatchResourcesRequest())
        try:
            for msg in stream:
                yield {
                    d.device.device_name: (d.device.pool_name, pb.HealthStatus.Name(d.health))
                    for d in msg.devices
                }
        finally:
            stream.cancel()


def allocated_claim(
    name: str,
    *,
    namespace: str = "default",
    results: Sequence[dict[str, Any]] | None = None,
    configs: Sequence[dict[str, Any]] = (),
    node: str | None = NODE,
    allocated: bool = True,
) -> dict[str, Any]:
    """A ResourceClaim as the scheduler leaves it. `results` default: one whole gpu-0."""
    if results is None:
        results = [result("gpu", "gpu-0")]
    requests = sorted({r["request"].split("/")[0] for r in results}) or ["gpu"]
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {"name": r, "exactly": {"deviceClassName": "vgpu.sharing.dev"}}
                    for r in requests
                ]
            }
        },
    }
    if allocated:
        allocation: dict[str, Any] = {"devices": {"results": list(results)}}
        if configs:
            allocation["devices"]["config"] = list(configs)
        if node is not None:
            allocation["nodeSelector"] = {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            }
        claim["status"] = {"allocation": allocation}
    return claim


def result(
    request: str,
    device: str,
    *,
    memory: str | None = None,
    cores: str | None = None,
    driver: str = DRIVER,
    pool: str = NODE,
    share: bool = True,
) -> dict[str, Any]:
    r: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    consumed = {}
    if memory is not None:
        consumed["memory"] = memory
    if cores is not None:
        consumed["cores"] = cores
    if consumed:
        r["consumedCapacity"] = consumed
    if share and consumed:
        r["shareID"] = str(uuid.uuid4())
    return r


def vgpu_config(source: str, parameters: dict[str, Any], requests: Sequence[str] = ()) -> Any:
    """An allocation config entry for our driver (parameters without apiVersion/kind)."""
    params = {"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", **parameters}
    entry: dict[str, Any] = {"source": source, "opaque": {"driver": DRIVER, "parameters": params}}
    if requests:
        entry["requests"] = list(requests)
    return entry


def claim_id(stored: dict[str, Any]) -> ClaimId:
    m = stored["metadata"]
    return ClaimId(namespace=m["namespace"], name=m["name"], uid=m["uid"])

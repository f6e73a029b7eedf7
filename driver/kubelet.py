"""The gRPC servers the kubelet talks to, on unix sockets.

  <registrar dir>/<driver>-reg.sock   pluginregistration.Registration
                                      (GetInfo, NotifyRegistrationStatus)
  <plugins dir>/<driver>/dra.sock     k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin
                                      k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin
                                      v1.DRAResourceHealth, v1alpha1.DRAResourceHealth
                                      (NodeWatchResources streams)

Health streams: the kubelet takes v1 when both versions are advertised; kubelets older than
mid-2026 know only v1alpha1. Every message carries the complete device list with each device's
cause in `message`, and is sent at the start, on every change and again every `health_resend`
seconds, each time with a fresh last_updated_time: the kubelet turns a device Unknown when its
last report is older than the health check timeout (ours: HEALTH_CHECK_TIMEOUT_SECONDS; its own
default of 30 s where it ignores that field), so an idle stream must keep re-asserting the list.

A failed registration (NotifyRegistrationStatus with plugin_registered=false) is logged and
retried: the registration socket is re-created after a backoff, which the kubelet's plugin
watcher sees as a new plugin and calls GetInfo again. The DRA socket keeps serving meanwhile.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from driver.backoff import Backoff
from driver.claims import ClaimRef
from driver.health import HealthBroadcaster
from driver.opmetrics import OperationMetrics
from driver.state import PrepareResult

log = logging.getLogger(__name__)


def _generated(name: str) -> Any:
    # The generated modules are untyped (protoc's .pyi stubs do not pass mypy --strict);
    # importing them dynamically keeps the type checker out of generated code.
    return importlib.import_module(f"driver.proto.{name}")


def _grpc_module(name: str) -> Any:
    return _generated(f"{name}_pb2_grpc")


dra_v1_pb2 = _generated("dra_v1_pb2")
dra_v1beta1_pb2 = _generated("dra_v1beta1_pb2")
health_v1alpha1_pb2 = _generated("health_v1alpha1_pb2")
health_v1_pb2 = _generated("health_v1_pb2")
pluginregistration_pb2 = _generated("pluginregistration_pb2")


SUPPORTED_VERSIONS = (
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
)
HEALTH_CHECK_TIMEOUT_SECONDS = 60
# Re-send the full list this often: well within our timeout and the kubelet's 30 s default.
HEALTH_RESEND_SECONDS = 10.0
_UNIX_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_HEALTH_POLL_SECONDS = 0.5  # how often an idle health stream checks that its client is still there
# The DRA server's worker threads: a gRPC (sync) server runs every call, streams included, on one
# thread pool, and a health stream holds its thread for as long as it is open. Health streams are
# therefore admitted up to MAX_HEALTH_STREAMS at a time (the kubelet opens one; more are refused
# with RESOURCE_EXHAUSTED), and the pool has PREPARE_WORKERS threads on top of those: open
# streams can never take the threads prepare and unprepare need.
PREPARE_WORKERS = 16
MAX_HEALTH_STREAMS = 4

PrepareFn = Callable[[Sequence[ClaimRef]], dict[str, PrepareResult]]
UnprepareFn = Callable[[Sequence[ClaimRef]], dict[str, str]]


@dataclass(frozen=True)
class PluginSockets:
    registration: Path  # <registrar dir>/<driver>-reg.sock
    dra: Path  # <plugins dir>/<driver>/dra.sock

    @staticmethod
    def of(registrar_dir: Path, plugins_dir: Path, driver_name: str) -> PluginSockets:
        return PluginSockets(
            registration=registrar_dir / f"{driver_name}-reg.sock",
            dra=plugins_dir / driver_name / "dra.sock",
        )


def _refs(claims: Any) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


class _DraService:
    """NodePrepareResources/NodeUnprepareResources for one API version (`pb` = its messages)."""

    def __init__(
        self,
        pb: ModuleType,
        version: str,
        prepare: PrepareFn,
        unprepare: UnprepareFn,
        ops: OperationMetrics,
    ) -> None:
        self._pb = pb
        self._ops = ops  # requests, durations and errors (driver/opmetrics.py)
        self._version = version
        self._prepare = prepare
        self._unprepare = unprepare
        self._has_share_id = "share_id" in pb.Device.DESCRIPTOR.fields_by_name

    def NodePrepareResources(self, request: Any, context: Any) -> Any:  # gRPC method names
        refs = _refs(request.claims)
        log.debug("%s NodePrepareResources: %s", self._version, ", ".join(map(str, refs)))
        results = self._ops.call("prepare", self._prepare, refs)
        resp = self._pb.NodePrepareResourcesResponse()
        for ref in refs:
            r = results[ref.uid]
            entry = resp.claims[ref.uid]
            if r.error:
                entry.error = r.error
                continue
            for d in r.devices:
                dev = entry.devices.add(
                    request_names=list(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=list(d.cdi_device_ids),
                )
                if self._has_share_id and d.share_id:
                    dev.share_id = d.share_id
        return resp

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        refs = _refs(request.claims)
        log.debug("%s NodeUnprepareResources: %s", self._version, ", ".join(map(str, refs)))
        errors = self._ops.call("unprepare", self._unprepare, refs)
        resp = self._pb.NodeUnprepareResourcesResponse()
        for ref in refs:
            resp.claims[ref.uid].error = errors.get(ref.uid, "")
        return resp


class _HealthService:
    """NodeWatchResources for one API version (`pb` = its messages); the streams of both
    versions share one admission limit."""

    def __init__(
        self,
        pb: ModuleType,
        version: str,
        health: HealthBroadcaster,
        pool_name: str,
        stopping: threading.Event,
        slots: threading.BoundedSemaphore,
        resend: float,
    ):
        self._pb = pb
        self._version = version
        self._health = health
        self._pool = pool_name
        self._stopping = stopping
        self._slots = slots
        self._resend = resend

    def _message(self, devices: Sequence[Any]) -> Any:
        pb = self._pb
        now = int(time.time())  # the list is re-asserted now (the kubelet times reports out)
        resp = pb.NodeWatchResourcesResponse()
        for d in devices:
            resp.devices.add(
                device=pb.DeviceIdentifier(pool_name=self._pool, device_name=d.device),
                health=pb.HEALTHY if d.healthy else pb.UNHEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=HEALTH_CHECK_TIMEOUT_SECONDS,
                message=d.message,
            )
        return resp

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        if not self._slots.acquire(blocking=False):
            log.warning("health stream refused: %d already open", MAX_HEALTH_STREAMS)
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_HEALTH_STREAMS} health streams already open; close one first",
            )
        try:
            yield from self._watch(context)
        finally:
            self._slots.release()

    def _watch(self, context: Any) -> Iterator[Any]:
        snap = self._health.snapshot()
        log.info("%s health stream opened (%d devices)", self._version, len(snap.devices))
        yield self._message(snap.devices)
        version = snap.version
        next_send = time.monotonic() + self._resend
        while context.is_active() and not self._stopping.is_set():
            wait = min(_HEALTH_POLL_SECONDS, max(0.0, next_send - time.monotonic()))
            newer = self._health.wait_newer(version, wait)
            if newer is None:
                if self._health.closed:
                    break
                if time.monotonic() < next_send:
                    continue
                newer = self._health.snapshot()  # nothing changed: re-assert the list
            version = newer.version
            next_send = time.monotonic() + self._resend
            yield self._message(newer.devices)
        log.info("%s health stream closed", self._version)


class _RegistrationService:
    def __init__(self, plugin: KubeletPlugin) -> None:
        self._plugin = plugin

    def GetInfo(self, request: Any, context: Any) -> Any:
        p = self._plugin
        log.info("kubelet GetInfo on %s", p.sockets.registration)
        return pluginregistration_pb2.PluginInfo(
            type="DRAPlugin",
            name=p.driver_name,
            endpoint=str(p.sockets.dra),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self._plugin.on_registration_status(request.plugin_registered, request.error)
        return pluginregistration_pb2.RegistrationStatusResponse()


class KubeletPlugin:
    """Owns both gRPC servers; start() binds the sockets, stop() removes them."""

    def __init__(
        self,
        *,
        driver_name: str,
        sockets: PluginSockets,
        prepare: PrepareFn,
        unprepare: UnprepareFn,
        health: HealthBroadcaster,
        pool_name: str,
        retry_backoff: tuple[float, float] = (1.0, 60.0),
        health_resend: float = HEALTH_RESEND_SECONDS,
    ) -> None:
        self.driver_name = driver_name
        self.ops = OperationMetrics(driver_name)  # served by the plugin's metrics endpoint
        self.sockets = sockets
        self._prepare = prepare
        self._unprepare = unprepare
        self._health = health
        self._pool_name = pool_name
        self._health_resend = health_resend
        self._backoff = Backoff(retry_backoff[0], 2.0, retry_backoff[1])
        self._retry_delays = self._backoff.delays()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._dra_server: grpc.Server | None = None
        self._reg_server: grpc.Server | None = None
        self._retry_timer: threading.Timer | None = None
        self.registered = threading.Event()
        self.registration_attempts = 0

    def start(self) -> None:
        self._stopping.clear()
        self._dra_server = self._serve_dra()
        try:
            with self._lock:
                self._reg_server = self._serve_registration()
        except BaseException:
            self._dra_server.stop(0).wait()  # do not leave a half-started plugin behind
            self._dra_server = None
            self.sockets.dra.unlink(missing_ok=True)
            raise
        log.info(
            "serving DRA (v1, v1beta1, health v1 and v1alpha1) on %s, registration on %s",
            self.sockets.dra,
            self.sockets.registration,
        )

    def stop(self, grace: float = 1.0) -> None:
        self._stopping.set()
        with self._lock:
            if self._retry_timer is not None:
                self._retry_timer.cancel()
                self._retry_timer = None
            reg, self._reg_server = self._reg_server, None
        # Registration first: the kubelet must stop routing to us before the DRA socket goes.
        if reg is not None:
            reg.stop(grace).wait()
            self.sockets.registration.unlink(missing_ok=True)
        if self._dra_server is not None:
            self._dra_server.stop(grace).wait()
            self._dra_server = None
            self.sockets.dra.unlink(missing_ok=True)

    @staticmethod
    def _bind(server: grpc.Server, path: Path) -> None:
        if len(os.fsencode(path)) > _UNIX_PATH_MAX:
            # gRPC's own failure for this is an opaque "Failed to add port".
            raise ValueError(
                f"socket path {path} is {len(os.fsencode(path))} bytes; unix sockets allow at "
                f"most {_UNIX_PATH_MAX}: use shorter plugin/registrar directories"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a stale socket from a previous run refuses the bind
        server.add_insecure_port(f"unix://{path}")
        server.start()

    def _serve_dra(self) -> grpc.Server:
        workers = PREPARE_WORKERS + MAX_HEALTH_STREAMS
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dra")
        )
        _grpc_module("dra_v1").add_DRAPluginServicer_to_server(
            _DraService(dra_v1_pb2, "v1", self._prepare, self._unprepare, self.ops), server
        )
        _grpc_module("dra_v1beta1").add_DRAPluginServicer_to_server(
            _DraService(dra_v1beta1_pb2, "v1beta1", self._prepare, self._unprepare, self.ops),
            server,
        )
        slots = threading.BoundedSemaphore(MAX_HEALTH_STREAMS)
        for version, pb in (("v1", health_v1_pb2), ("v1alpha1", health_v1alpha1_pb2)):
            _grpc_module(f"health_{version}").add_DRAResourceHealthServicer_to_server(
                _HealthService(
                    pb,
                    version,
                    self._health,
                    self._pool_name,
                    self._stopping,
                    slots,
                    self._health_resend,
                ),
                server,
            )
        self._bind(server, self.sockets.dra)
        return server

    def _serve_registration(self) -> grpc.Server:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="reg"))
        _grpc_module("pluginregistration").add_RegistrationServicer_to_server(
            _RegistrationService(self), server
        )
        self._bind(server, self.sockets.registration)
        self.registration_attempts += 1
        return server

    def on_registration_status(self, registered: bool, error: str) -> None:
        if registered:
            log.info("registered with the kubelet as DRA driver %s", self.driver_name)
            self._retry_delays = self._backoff.delays()
            self.registered.set()
            return
        self.registered.clear()
        with self._lock:
            if self._stopping.is_set() or self._retry_timer is not None:
                return
            delay = next(self._retry_delays)
            log.error(
                "kubelet rejected the registration of %s: %s; re-registering in %.1fs",
                self.driver_name,
                error or "(no reason given)",
                delay,
            )
            self._retry_timer = threading.Timer(delay, self._reregister)
            self._retry_timer.daemon = True
            self._retry_timer.start()

    def _reregister(self) -> None:
        # Runs on the timer thread, never inside an RPC of the server it replaces.
        with self._lock:
            self._retry_timer = None
            if self._stopping.is_set():
                return
            old, self._reg_server = self._reg_server, None
        if old is not None:
            old.stop(0.5).wait()
        with self._lock:
            if self._stopping.is_set():
                return
            self._reg_server = self._serve_registration()
        log.info("re-created registration socket %s", self.sockets.registration)

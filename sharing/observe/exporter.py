"""`vgpu exporter`: Prometheus metrics of this node's GPUs and slices (docs/metrics.md).

The same Exporter serves `vgpu-kubelet-plugin --metrics-address`. Pieces: SliceFinder (which
slices exist: the plugin's data dir, --region files), NvmlPoller (NVML in a background thread:
a scrape never waits on NVML), ViewBuilder (the node now), VgpuCollector (the metric families),
and the watchdog (sharing/observe/watchdog.py) fed by every NVML pass.

Device health: `vgpu_device_healthy` is 0 for a GPU NVML cannot read, one it no longer lists
(lost), every GPU it listed while NVML itself does not answer (`vgpu_nvml_up` 0), and, in the
plugin, every GPU its health monitor holds unhealthy (critical XID): `device_health`, the same
source as the kubelet's health stream and the ResourceSlice taints (driver/main.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from sharing.claimlayout import DEFAULT_DRIVER_NAME
from sharing.observe.containers import ContainerUsage
from sharing.observe.metrics import CONTENT_TYPE, VgpuCollector, render_text
from sharing.observe.nodeview import LineLog, NodeView, ViewBuilder, ViolationCounts
from sharing.observe.nvml_reader import (
    DEFAULT_INTERVAL,
    DEFAULT_STALE_AFTER,
    GPU_LOST,
    GpuReading,
    NvmlPoller,
    NvmlReading,
)
from sharing.observe.podresources import DEFAULT_SOCKET as DEFAULT_POD_RESOURCES_SOCKET
from sharing.observe.podresources import PodResources
from sharing.observe.slices import DEFAULT_DATA_DIR, PodLookup, SliceFinder
from sharing.observe.watchdog import DEFAULT_MARGIN, EventSink, Watchdog

log = logging.getLogger(__name__)

DEFAULT_PORT = 9402  # dcgm-exporter has 9400
DEFAULT_CACHE_SECONDS = 1.0  # a served exposition is at most about this old
ACTIVE_WINDOW = 300.0  # seconds after the last scrape the cache is kept warm


NVML_UP = "vgpu_nvml_up"
_NVML_UP_HELP = (
    "1 if NVML answered the exporter's last pass in time, else 0 (no NVML figure is current)."
)

# GPU UUID -> why it is unhealthy ("" or absent: healthy), from the plugin's health monitor.
DeviceHealth = Callable[[], Mapping[str, str]]


class HealthView:
    """NVML's latest reading with device health applied: keeps every GPU NVML once listed, so
    a lost GPU, or every GPU while NVML is down, still has its series (healthy 0)."""

    def __init__(self, latest: Callable[[], NvmlReading], device_health: DeviceHealth | None):
        self._latest = latest
        self._device_health = device_health
        self._known: dict[str, GpuReading] = {}
        self._lock = threading.Lock()

    def nvml_up(self) -> bool:
        r = self._latest()
        return not r.error and not r.stale

    def latest(self) -> NvmlReading:
        r = self._latest()
        causes = dict(self._device_health()) if self._device_health is not None else {}
        with self._lock:
            if not r.error:
                self._known.update({g.uuid: g for g in r.gpus})
            known = dict(self._known)
        listed = {g.uuid for g in r.gpus}
        gpus = list(r.gpus)
        for uuid, g in sorted(known.items(), key=lambda kv: kv[1].index):
            if uuid not in listed:
                why = r.error or GPU_LOST
                gpus.append(_unhealthy(g, why))
        # NVML still reads a GPU with a critical XID: its figures stay, only its health changes
        gpus = [
            replace(g, healthy=False, error=causes[g.uuid]) if causes.get(g.uuid) else g
            for g in gpus
        ]
        by_uuid = {g.uuid: g for g in gpus}
        return NvmlReading(r.taken, tuple(gpus), r.error, r.stale, by_uuid)


def _unhealthy(g: GpuReading, why: str) -> GpuReading:
    return replace(g, healthy=False, utilization=None, processes=(), error=why)


class _NvmlUpCollector:
    def __init__(self, health: HealthView, hostname: str) -> None:
        self._health = health
        self._hostname = hostname

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(NVML_UP, _NVML_UP_HELP, labels=["Hostname"])
        fam.add_metric([self._hostname], 1.0 if self._health.nvml_up() else 0.0)
        yield fam


def nvml_up_text(up: bool, hostname: str) -> bytes:
    """The vgpu_nvml_up series in the text format."""
    host = hostname.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return (
        f"# HELP {NVML_UP} {_NVML_UP_HELP}\n# TYPE {NVML_UP} gauge\n"
        f'{NVML_UP}{{Hostname="{host}"}} {1 if up else 0}\n'
    ).encode()


class ListenError(ValueError):
    """A bad HOST:PORT. str() is one line."""


def parse_listen(text: str, default_port: int | None = None) -> tuple[str, int]:
    """ "HOST:PORT", "[v6]:PORT" or ":PORT" (all interfaces); with a default_port also a HOST
    alone ("::1" is one: a colon outside brackets belongs to an IPv6 address, never a port)."""
    host, sep, port = text.rpartition(":")
    if not sep or (host and not host.endswith("]") and ":" in host):
        host, port = text, "" if default_port is None or not text else str(default_port)
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        alone = "" if default_port is None else f" (a HOST alone: port {default_port})"
        raise ListenError(
            f"{text!r}: expected HOST:PORT, [IPv6]:PORT or :PORT{alone}, the port 0..65535 "
            f"(e.g. :{DEFAULT_PORT})"
        )
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or "0.0.0.0", int(port)


@dataclass(frozen=True)
class ExporterConfig:
    data_dir: Path | None = DEFAULT_DATA_DIR
    regions: tuple[str, ...] = ()
    hostname: str = ""
    nvml_interval: float = DEFAULT_INTERVAL
    nvml_stale_after: float = DEFAULT_STALE_AFTER
    enforce: str = "none"
    margin: int = DEFAULT_MARGIN
    kill_grace: float = 5.0
    cache_seconds: float = DEFAULT_CACHE_SECONDS  # 0: read the node at every scrape
    watchdog: bool = True  # False: metrics only (the watchdog needs the host's PIDs)
    driver_name: str = DEFAULT_DRIVER_NAME  # the dra_driver_name label of claims' series
    # the kubelet's PodResources API: the pod and container names of claims ("" = not asked)
    pod_resources_socket: str = DEFAULT_POD_RESOURCES_SOCKET


class Exporter:
    """Slices + NVML + watchdog + HTTP endpoint. start() returns the bound (host, port)."""

    def __init__(
        self,
        config: ExporterConfig,
        *,
        nvml_reader: Callable[[], NvmlReading] | None = None,
        events: EventSink | None = None,
        pods: PodLookup | None = None,
        device_health: DeviceHealth | None = None,
        extra: Callable[[], bytes] | None = None,
    ) -> None:
        """device_health: the plugin's GPU health (UUID -> cause), applied to the NVML view.
        extra: more exposition appended to every scrape, read at the scrape (the plugin's
        operation metrics)."""
        self.config = config
        self.extra = extra
        self.hostname = config.hostname or socket.gethostname()
        self.violations = ViolationCounts()
        kw: dict[str, Any] = {
            "interval": config.nvml_interval,
            "stale_after": config.nvml_stale_after,
            "on_reading": self._on_reading,
        }
        if nvml_reader is not None:
            kw["reader"] = nvml_reader
        self.poller = NvmlPoller(**kw)
        self.health = HealthView(self.poller.latest, device_health)
        lines = LineLog()  # an unreadable slice is one log line, whichever builder sees it
        # memory by container, from the watchdog's NVML passes (host PIDs: with the watchdog)
        self.containers = ContainerUsage()
        socket_path = config.pod_resources_socket
        self.pod_resources = PodResources(socket_path) if socket_path else None
        self.view = ViewBuilder(
            SliceFinder(config.data_dir, config.regions, pods, self.pod_resources),
            self.health.latest,
            self.violations,
            lines,
            self.containers,
        )
        # the watchdog's own builder: its samples must not shorten the scrapes' rate windows
        self._wd_view = ViewBuilder(
            SliceFinder(config.data_dir, config.regions, pods),
            self.poller.latest,
            self.violations,
            lines,
        )
        self.watchdog = Watchdog(
            self.violations,
            enforce=config.enforce,
            margin=config.margin,
            kill_grace=config.kill_grace,
            events=events,
            # the plugin's installed shim: a claim's processes must map this very file
            shim_file=config.data_dir / "lib" / "libvgpu.so" if config.data_dir else None,
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = VgpuCollector(self.view.build, self.hostname, config.driver_name)
        self.registry.register(self.collector)
        self.registry.register(_NvmlUpCollector(self.health, self.hostname))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._cache: tuple[float, bytes, NodeView] | None = None  # (taken, text, view)
        self._cache_lock = threading.Lock()
        self._last_scrape = -1e18
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._warm: threading.Thread | None = None

    def _on_reading(self, reading: NvmlReading) -> None:
        if self.config.watchdog:
            view = self._wd_view.build(rates=False)
            self.watchdog.check(view, reading)
            self.containers.update(view, reading, skip_pid=os.getpid())

    def _refresh(self) -> tuple[float, bytes, NodeView]:
        started, taken = time.perf_counter(), time.monotonic()
        view = self.view.build(commit=False)
        text = render_text(view, self.hostname, started, self.config.driver_name)
        entry = (taken, text + nvml_up_text(self.health.nvml_up(), self.hostname), view)
        with self._cache_lock:
            self._cache = entry
        return entry

    def render(self) -> bytes:
        """One scrape's exposition (what GET /metrics answers).

        With cache_seconds > 0 it comes from the cache a background thread refreshes while the
        exporter is being scraped (so a scrape costs a copy, not a read of every slice); it is
        read here only when the cache is older than cache_seconds (the first scrape after a
        quiet spell). The view a scrape is served becomes the base of the next compute shares,
        so vgpu_slice_compute_used_ratio covers the interval between scrapes.
        """
        now = time.monotonic()
        self._last_scrape = now
        with self._cache_lock:
            entry = self._cache
        if entry is None or now - entry[0] > self.config.cache_seconds:
            entry = self._refresh()
        self.view.commit(entry[2])
        self._wake.set()
        return entry[1] + self.extra() if self.extra is not None else entry[1]

    def _keep_warm(self) -> None:
        period = self.config.cache_seconds * 0.8  # + one read of the node: stays under the bound
        while not self._stopping.is_set():
            if time.monotonic() - self._last_scrape > ACTIVE_WINDOW:
                self._wake.clear()
                self._wake.wait()  # nobody scrapes: no work until somebody does
                continue
            try:
                self._refresh()
            except Exception:
                log.exception("refreshing the metrics failed")
            self._stopping.wait(period)

    def start(self, host: str, port: int) -> tuple[str, int]:
        self.poller.start()
        if self.pod_resources is not None:
            self.pod_resources.poke()  # the first scrape finds the kubelet's answer if it is quick
        server_class = _Server6 if ":" in host else _Server
        try:
            self._server = server_class((host, port), _Handler)
        except OSError:
            self.poller.stop()
            raise
        self._server.exporter = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-http", daemon=True
        )
        self._thread.start()
        if self.config.cache_seconds > 0:
            self._warm = threading.Thread(target=self._keep_warm, name="metrics-cache", daemon=True)
            self._warm.start()
        bound = self._server.server_address
        return str(bound[0]), int(bound[1])

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._warm is not None:
            self._warm.join(10)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.poller.stop()
        self.view.close()
        self._wd_view.close()
        if self.pod_resources is not None:
            self.pod_resources.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    exporter: Exporter


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body, ctype, code = self.server.exporter.render(), CONTENT_TYPE, 200
            except Exception as e:  # a bug must answer 500, not kill the connection silently
                log.exception("scrape failed")
                body, ctype, code = f"scrape failed: {e}\n".encode(), "text/plain", 500
        elif path == "/":
            body = b'<html><body><a href="/metrics">vgpu-sharing metrics</a></body></html>\n'
            ctype, code = "text/html", 200
        else:
            body, ctype, code = b"not found: try /metrics\n", "text/plain", 404
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the log

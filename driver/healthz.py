"""HTTP /healthz (liveness) and /readyz (readiness) for the kubelet's probes
(`--healthcheck-port`).

/healthz: 200 while starting (waiting for NVML or the API server) and, once serving, when both
gRPC sockets (registration and DRA) accept a gRPC connection; 503 otherwise. /readyz: 200 once
registered with the kubelet and the node's ResourceSlices are published. The JSON body says which part is failing and
also carries what does not affect liveness (API server reachability, publishing mode): an API
server outage must not get the plugin restarted, its sockets keep serving prepared claims.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Status:
    live: bool
    details: dict[str, Any] = field(default_factory=dict)


def socket_serves_grpc(path: Path, timeout: float = 1.0) -> bool:
    """True if a gRPC channel to the unix socket becomes ready within timeout."""
    if not path.exists():
        return False
    channel = grpc.insecure_channel(f"unix://{path}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


class HealthServer:
    """Serves GET /healthz from a thread; check() decides the answer per request."""

    def __init__(
        self,
        port: int,
        check: Callable[[], Status],
        host: str = "",
        ready: Callable[[], Status] | None = None,
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                probe = {"/healthz": outer.check, "/readyz": outer.ready}.get(path)
                if probe is None:
                    self._send(404, {"error": f"not found: {self.path}; try /healthz, /readyz"})
                    return
                try:
                    status = probe()
                except Exception as e:  # a failing check is a failing probe, not a crash
                    log.exception("health check failed")
                    status = Status(False, {"error": str(e)})
                self._send(200 if status.live else 503, {"live": status.live, **status.details})

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body, sort_keys=True).encode() + b"\n"
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("healthz: " + format, *args)

        self.check = check
        self.ready = ready or check
        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="healthz", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()
        log.info("serving /healthz on port %d", self.port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

"""`vgpu exporter`: the command half of the exporter (sharing/observe/exporter.py): its flags,
the flags `vgpu top` shares to find slices, and the serving loop."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from sharing.claimlayout import DEFAULT_DRIVER_NAME
from sharing.gpus import use_simulator
from sharing.observe.exporter import (
    DEFAULT_CACHE_SECONDS,
    DEFAULT_PORT,
    Exporter,
    ExporterConfig,
    parse_listen,
)
from sharing.observe.podresources import DEFAULT_SOCKET as DEFAULT_POD_RESOURCES_SOCKET
from sharing.observe.slices import DEFAULT_DATA_DIR
from sharing.observe.watchdog import DEFAULT_MARGIN, ENFORCE_MODES
from sharing.quantity import parse_bytes

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "exporter",
        help="serve Prometheus metrics of this node's GPUs and slices",
        description="Serve Prometheus metrics of this node's GPUs and slices (docs/metrics.md).",
    )
    add_discovery_flags(p)
    p.add_argument(
        "--listen",
        default=f":{DEFAULT_PORT}",
        metavar="HOST:PORT",
        help=f"address to serve /metrics on (default :{DEFAULT_PORT}, all interfaces)",
    )
    p.add_argument(
        "--hostname", default="", help="the Hostname/hostname label (default: this host's name)"
    )
    p.add_argument(
        "--driver-name",
        default=DEFAULT_DRIVER_NAME,
        help="the DRA driver the claims' slices belong to: their dra_driver_name label (default "
        f"{DEFAULT_DRIVER_NAME}, the plugin's default --driver-name)",
    )
    p.add_argument(
        "--pod-resources-socket",
        default=DEFAULT_POD_RESOURCES_SOCKET,
        metavar="PATH",
        help="the kubelet's PodResources API socket, which names the pods and containers of "
        f"claims (default {DEFAULT_POD_RESOURCES_SOCKET}; empty: do not ask)",
    )
    p.add_argument(
        "--cache",
        type=float,
        default=DEFAULT_CACHE_SECONDS,
        metavar="SECONDS",
        help="serve an exposition at most about this old, refreshed in the background while "
        f"the exporter is scraped (default {DEFAULT_CACHE_SECONDS:g}; 0: read at every scrape)",
    )
    p.add_argument(
        "--enforce",
        choices=ENFORCE_MODES,
        default="none",
        help="watchdog: none (count and log violations) or kill (also SIGTERM, then SIGKILL, "
        "the offending processes)",
    )
    p.add_argument(
        "--watchdog-margin",
        default=str(DEFAULT_MARGIN),
        metavar="BYTES",
        help="how far over its quota NVML may see a slice before it is a violation "
        f"(default {DEFAULT_MARGIN >> 20}Mi)",
    )
    p.set_defaults(func=run)


def add_discovery_flags(p: argparse.ArgumentParser) -> None:
    """The flags `vgpu exporter` and `vgpu top` find slices with."""
    p.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help=f"the DRA plugin's data directory (default {DEFAULT_DATA_DIR}); its claims/ are "
        "the slices",
    )
    p.add_argument(
        "--region",
        action="append",
        default=[],
        metavar="FILE",
        help="also show the slice of this accounting file (as given to `vgpu run --region`); "
        "repeatable",
    )
    p.add_argument("--sim", action="store_true", help="read the simulated GPU's NVML")


def config_from_args(args: argparse.Namespace) -> ExporterConfig:
    margin = parse_bytes(str(getattr(args, "watchdog_margin", DEFAULT_MARGIN)))
    return ExporterConfig(
        data_dir=args.data_dir,
        regions=tuple(args.region),
        hostname=getattr(args, "hostname", ""),
        driver_name=getattr(args, "driver_name", DEFAULT_DRIVER_NAME),
        pod_resources_socket=getattr(args, "pod_resources_socket", DEFAULT_POD_RESOURCES_SOCKET),
        enforce=getattr(args, "enforce", "none"),
        margin=margin,
        cache_seconds=_cache_seconds(getattr(args, "cache", DEFAULT_CACHE_SECONDS)),
    )


def _cache_seconds(v: float) -> float:
    if not 0 <= v <= 60:
        raise ValueError(f"--cache {v:g}: allowed 0 (no cache) to 60 seconds")
    return v


def run(args: argparse.Namespace) -> int:
    try:
        host, port = parse_listen(args.listen)
        config = config_from_args(args)
    except ValueError as e:
        print(f"vgpu exporter: {e}", file=sys.stderr)
        return 2
    if args.sim:
        use_simulator()
    exporter = Exporter(config)
    try:
        host, port = exporter.start(host, port)
    except OSError as e:
        print(f"vgpu exporter: cannot listen on {args.listen}: {e.strerror}", file=sys.stderr)
        return 1
    shown = f"[{host}]" if ":" in host else host
    log.info("serving http://%s:%d/metrics (slices from %s)", shown, port, _sources(config))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    exporter.stop()
    return 0


def _sources(config: ExporterConfig) -> str:
    parts = [f"{config.data_dir}/claims"] if config.data_dir else []
    parts += config.regions
    return ", ".join(parts) or "nowhere"

"""The plugin's own operation metrics, named, labelled and bucketed as NVIDIA's DRA driver
exports them (kubernetes-sigs/dra-driver-nvidia-gpu, pkg/metrics/dra_requests.go), so that its
dashboards and alerts read ours by the `driver` label:

  nvidia_dra_requests_total{driver,operation}              NodePrepare/NodeUnprepareResources calls
  nvidia_dra_request_duration_seconds{driver,operation}    their duration (histogram)
  nvidia_dra_requests_inflight{driver,operation}           calls being served
  nvidia_dra_node_prepare_errors_total{driver,error_type}  failures, by type (below)
  nvidia_dra_node_unprepare_errors_total{driver,error_type}
  nvidia_dra_prepared_devices{node,driver,device_type}     prepared devices (the checkpoint)
  vgpu_dra_prepared_claims{node,driver}                    prepared claims (the checkpoint)

Bursting (docs/policy.md, "Memory that bursts and is given back"), once track_burst() is called:

  vgpu_slice_borrowed_bytes{driver,claim,device}    what a bursting claim uses above its request
  vgpu_burst_grant_bytes{driver,claim,device}       what it may use above its request now
  vgpu_burst_pool_bytes{driver,device}              the device's pool (memory no claim was given)
  vgpu_burst_reclaims_total{driver,outcome}         reclaims in prepare: freed | evicted | timeout
  vgpu_burst_reclaim_seconds{driver}                from the prepare that needed the memory to
                                                    the memory being free (histogram)

operation: prepare | unprepare (a kubelet call of either API version). error_type: `claim`, one
per claim the call answered with an error (the claim cannot be prepared here, or its files could
not be made or removed); `request`, a call that failed as a whole (the kubelet got a gRPC error).
device_type: `gpu` (a shared GPU, sharing mode) or `partition` (a fixed slice, partition mode).

Served on the plugin's metrics endpoint (--metrics-address), after the exporter's series.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from driver.checkpoint import PREPARE_COMPLETED, ClaimEntry
from driver.devicenames import PARTITION, parse

log = logging.getLogger(__name__)

OPERATIONS = ("prepare", "unprepare")
ERROR_TYPES = ("claim", "request")
# NVIDIA's metrics.ExponentialBuckets(0.05, 2, 9): 50 ms .. 12.8 s
BUCKETS = tuple(0.05 * 2**i for i in range(9))

R = TypeVar("R", bound=Mapping[str, Any])
# reclaim latency: 10 ms .. about 41 s (the longest grace or timeout is 40 s)
RECLAIM_BUCKETS = tuple(0.01 * 2**i for i in range(13))


class BurstReading:
    """What the burst series show at one scrape (driver/state.py DeviceState.burst_reading)."""

    def __init__(self, slices: list[tuple[str, int, int, int]], pools: dict[int, int],
                 outcomes: dict[str, int], seconds: list[float]) -> None:  # fmt: skip
        self.slices = slices  # (namespace/name, GPU index, borrowed, grant)
        self.pools = pools  # GPU index -> pool bytes
        self.outcomes = outcomes
        self.seconds = seconds


def _failed(answer: object) -> bool:
    """A claim's answer is an error: a prepare result's .error, or an unprepare error string."""
    return bool(answer if isinstance(answer, str) else getattr(answer, "error", ""))


class OperationMetrics:
    """The request series of one driver; `registry` holds them (and prepared claims, once
    track_prepared() is called)."""

    def __init__(self, driver: str) -> None:
        self.driver = driver
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("driver", "operation")
        self._requests = Counter("nvidia_dra_requests", "Total number of DRA prepare and "
                                 "unprepare requests.", labels, registry=self.registry)  # fmt: skip
        self._duration = Histogram(
            "nvidia_dra_request_duration_seconds",
            "Duration of DRA prepare and unprepare requests.",
            labels,
            buckets=BUCKETS,
            registry=self.registry,
        )
        self._inflight = Gauge("nvidia_dra_requests_inflight", "Number of in-flight DRA prepare "
                               "and unprepare requests.", labels, registry=self.registry)  # fmt: skip
        self._errors = {
            op: Counter(
                f"nvidia_dra_node_{op}_errors",
                f"Total number of failures during DRA node {op} for kubelet plugins.",
                ("driver", "error_type"),
                registry=self.registry,
            )
            for op in OPERATIONS
        }
        for op in OPERATIONS:  # every series from the first scrape on, as NVIDIA's driver does
            self._requests.labels(driver, op)
            self._duration.labels(driver, op)
            self._inflight.labels(driver, op)
            for t in ERROR_TYPES:
                self._errors[op].labels(driver, t)
        self._prepared: _Prepared | None = None

    def call(self, operation: str, fn: Callable[[Sequence[Any]], R], refs: Sequence[Any]) -> R:
        """fn(refs), counted as one `operation` request: in flight while it runs, its duration,
        and its failures (each claim answered with an error; the call raising)."""
        inflight = self._inflight.labels(self.driver, operation)
        inflight.inc()
        started = time.perf_counter()
        try:
            answers = fn(refs)
        except BaseException:
            self._errors[operation].labels(self.driver, "request").inc()
            raise
        finally:
            inflight.dec()
            self._requests.labels(self.driver, operation).inc()
            self._duration.labels(self.driver, operation).observe(time.perf_counter() - started)
        failed = sum(1 for a in answers.values() if _failed(a))
        if failed:
            self._errors[operation].labels(self.driver, "claim").inc(failed)
        return answers

    def track_prepared(self, node: str, entries: Callable[[], list[ClaimEntry]]) -> None:
        """Serve the prepared claims and devices, read from `entries` (the checkpoint) at each
        scrape."""
        if self._prepared is None:
            self._prepared = _Prepared(node, self.driver, entries)
            self.registry.register(self._prepared)

    def track_burst(self, burst: Callable[[], BurstReading]) -> None:
        """Serve the burst pool's series, read from `burst` at each scrape."""
        self.registry.register(_Burst(self.driver, burst))

    def render(self) -> bytes:
        """The exposition of these series (text format 0.0.4)."""
        return generate_latest(self.registry)


class _Prepared(Collector):
    def __init__(self, node: str, driver: str, entries: Callable[[], list[ClaimEntry]]) -> None:
        self.node = node
        self.driver = driver
        self.entries = entries

    def describe(self) -> list[Metric]:
        return []  # read at the scrape only

    def collect(self) -> Iterator[Metric]:
        done = [e for e in self.entries() if e.state == PREPARE_COMPLETED]
        devices = {"gpu": 0, "partition": 0}
        for e in done:
            for d in e.devices:
                part = parse(d.device_name, PARTITION) is not None
                devices["partition" if part else "gpu"] += 1
        fam = GaugeMetricFamily(
            "nvidia_dra_prepared_devices",
            "Current number of prepared devices by device type.",
            labels=("node", "driver", "device_type"),
        )
        for t, n in devices.items():
            fam.add_metric([self.node, self.driver, t], float(n))
        yield fam
        claims = GaugeMetricFamily(
            "vgpu_dra_prepared_claims",
            "Claims prepared on this node (the plugin's checkpoint).",
            labels=("node", "driver"),
        )
        claims.add_metric([self.node, self.driver], float(len(done)))
        yield claims


class _Burst(Collector):
    def __init__(self, driver: str, read: Callable[[], BurstReading]) -> None:
        self.driver = driver
        self.read = read

    def describe(self) -> list[Metric]:
        return []  # read at the scrape only

    def collect(self) -> Iterator[Metric]:
        r = self.read()
        borrowed = GaugeMetricFamily(
            "vgpu_slice_borrowed_bytes",
            "Bytes a bursting claim uses above its request on a device (its live processes).",
            labels=("driver", "claim", "device"),
        )
        grant = GaugeMetricFamily(
            "vgpu_burst_grant_bytes",
            "Bytes a bursting claim may use above its request on a device now.",
            labels=("driver", "claim", "device"),
        )
        for claim, gpu, b, g in r.slices:
            borrowed.add_metric([self.driver, claim, f"gpu-{gpu}"], float(b))
            grant.add_metric([self.driver, claim, f"gpu-{gpu}"], float(g))
        yield borrowed
        yield grant
        pool = GaugeMetricFamily("vgpu_burst_pool_bytes", "A device's memory no prepared claim "
                                 "was allocated.", labels=("driver", "device"))  # fmt: skip
        for gpu, n in sorted(r.pools.items()):
            pool.add_metric([self.driver, f"gpu-{gpu}"], float(n))
        yield pool
        total = CounterMetricFamily("vgpu_burst_reclaims", "Burst reclaims in prepare, by "
                                    "outcome.", labels=("driver", "outcome"))  # fmt: skip
        for outcome, n in r.outcomes.items():
            total.add_metric([self.driver, outcome], float(n))
        yield total
        buckets = [(f"{b:g}", float(sum(1 for x in r.seconds if x <= b))) for b in RECLAIM_BUCKETS]
        buckets.append(("+Inf", float(len(r.seconds))))
        hist = HistogramMetricFamily("vgpu_burst_reclaim_seconds", "From the prepare that needed "
                                     "borrowed memory to the memory being free.",
                                     labels=("driver",))  # fmt: skip
        hist.add_metric([self.driver], buckets, sum_value=float(sum(r.seconds)))
        yield hist

"""The plugin's own operation metrics (driver/opmetrics.py), named as NVIDIA's DRA driver names
them: a real `vgpu-kubelet-plugin --metrics-address` on the simulated GPU, prepare and unprepare
through its gRPC socket by the kubelet stand-in, read over HTTP from its metrics endpoint. And
the in-flight gauge while a call is held, in process (a call cannot be held inside the real
plugin without a test hook)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from driver.checkpoint import PREPARE_COMPLETED, PREPARE_STARTED, ClaimEntry, PreparedDevice
from driver.opmetrics import BUCKETS, OperationMetrics
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer, free_port
from tests.support.observers import Sample, only, scrape, scrape_until, value
from tests.support.plugin_e2e import (
    DRIVER,
    PluginProcess,
    device,
    root,
    server,
    sim_ready,
    wait_names,
    write_config,
)

__all__ = ["root", "server", "sim_ready"]  # fixtures used by name


def _ops(s: list[Sample], name: str, **labels: str) -> float:
    return value(s, name, driver=DRIVER, **labels)


@pytest.mark.slow
def test_plugin_counts_its_requests_errors_and_prepared_claims(
    sim_ready: None, server: FakeApiServer, root: Path
) -> None:
    write_config(root / "simgpu.json", [device(0)])
    mport = free_port()
    url = f"http://127.0.0.1:{mport}"
    p = PluginProcess(server, root, "--metrics-address", f"127.0.0.1:{mport}", "--watchdog=false")
    try:
        wait_names(server, p, ["gpu-0"])
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        s = scrape(url)  # every series from the start, at 0
        for op in ("prepare", "unprepare"):
            assert _ops(s, "nvidia_dra_requests_total", operation=op) == 0
            assert _ops(s, "nvidia_dra_requests_inflight", operation=op) == 0
            assert _ops(s, "nvidia_dra_request_duration_seconds_count", operation=op) == 0
            for t in ("claim", "request"):
                assert _ops(s, f"nvidia_dra_node_{op}_errors_total", error_type=t) == 0
        assert _ops(s, "vgpu_dra_prepared_claims", node="node-a") == 0
        share = {"consumedCapacity": {"memory": "1Gi", "cores": "30"}}
        good = server.put(allocated_claim("ok", results=[result("gpu", "gpu-0") | share]))
        # allocated a device this node does not have: the claim's answer is an error
        bad = server.put(allocated_claim("bad", results=[result("gpu", "gpu-7") | share]))
        got = kubelet.prepare([claim_id(good), claim_id(bad)])
        assert got[good["metadata"]["uid"]].error == ""
        assert got[bad["metadata"]["uid"]].error != ""
        s = scrape(url)
        assert _ops(s, "nvidia_dra_requests_total", operation="prepare") == 1  # one call
        assert _ops(s, "nvidia_dra_request_duration_seconds_count", operation="prepare") == 1
        assert _ops(s, "nvidia_dra_request_duration_seconds_bucket", operation="prepare",
                    le="+Inf") == 1  # fmt: skip
        assert _ops(s, "nvidia_dra_node_prepare_errors_total", error_type="claim") == 1
        assert _ops(s, "nvidia_dra_requests_inflight", operation="prepare") == 0
        assert _ops(s, "vgpu_dra_prepared_claims", node="node-a") == 1
        assert _ops(s, "nvidia_dra_prepared_devices", node="node-a", device_type="gpu") == 1
        # the exporter's own series are on the same endpoint (an exposition up to 1 s old)
        s = scrape_until(url, lambda s: bool(only(s, "vgpu_slice_memory_limit_bytes")))
        assert value(s, "vgpu_slice_memory_limit_bytes", claim="ok") == 1 << 30

        assert kubelet.unprepare([claim_id(good)]) == {good["metadata"]["uid"]: ""}
        s = scrape(url)
        assert _ops(s, "nvidia_dra_requests_total", operation="unprepare") == 1
        assert _ops(s, "nvidia_dra_node_unprepare_errors_total", error_type="claim") == 0
        assert _ops(s, "vgpu_dra_prepared_claims", node="node-a") == 0
        assert _ops(s, "nvidia_dra_prepared_devices", node="node-a", device_type="gpu") == 0
        kubelet.close()
    finally:
        code = p.terminate()
    assert code == 0, p.output()


def _parse(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text.decode())
        for x in f.samples
    }


def _get(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
         **labels: str) -> float:  # fmt: skip
    return samples[(name, tuple(sorted(labels.items())))]


def test_in_flight_while_a_call_runs_and_a_failed_call_counts_as_a_request_error() -> None:
    ops = OperationMetrics("d.example")
    entered, release = threading.Event(), threading.Event()

    def held(refs: Sequence[str]) -> dict[str, str]:
        entered.set()
        release.wait()
        return {r: "" for r in refs}

    t = threading.Thread(target=ops.call, args=("unprepare", held, ["a"]))
    t.start()
    assert entered.wait(30)
    s = _parse(ops.render())
    assert _get(s, "nvidia_dra_requests_inflight", driver="d.example", operation="unprepare") == 1
    assert _get(s, "nvidia_dra_requests_total", driver="d.example", operation="unprepare") == 0
    release.set()
    t.join()
    s = _parse(ops.render())
    assert _get(s, "nvidia_dra_requests_inflight", driver="d.example", operation="unprepare") == 0
    assert _get(s, "nvidia_dra_requests_total", driver="d.example", operation="unprepare") == 1

    def broken(refs: Sequence[str]) -> dict[str, str]:
        raise OSError("disk gone")

    with pytest.raises(OSError):
        ops.call("prepare", broken, ["a"])
    s = _parse(ops.render())
    assert _get(s, "nvidia_dra_node_prepare_errors_total", driver="d.example",
                error_type="request") == 1  # fmt: skip
    assert _get(s, "nvidia_dra_requests_total", driver="d.example", operation="prepare") == 1
    # NVIDIA's buckets: 0.05 s doubling, nine of them
    les = {
        float(dict(k[1])["le"]) for k in s if k[0] == "nvidia_dra_request_duration_seconds_bucket"
    }
    assert les == {*BUCKETS, float("inf")}
    assert min(les) == 0.05 and sorted(les)[-2] == pytest.approx(12.8)


def test_prepared_devices_by_type_count_completed_claims_only() -> None:
    ops = OperationMetrics("d.example")
    dev = PreparedDevice(("r",), "node-x", "gpu-0", ("k/c=u",))
    part = PreparedDevice(("r",), "node-x", "gpu-1-slice-2", ("k/c=v",))
    entries = [
        ClaimEntry("u1", "ns", "a", PREPARE_COMPLETED, "/s", "/d", (dev,)),
        ClaimEntry("u2", "ns", "b", PREPARE_COMPLETED, "/s", "/d", (part, part)),
        ClaimEntry("u3", "ns", "c", PREPARE_STARTED, "/s", "/d", (dev,)),
    ]
    ops.track_prepared("node-x", lambda: entries)
    s = _parse(ops.render())
    base = {"node": "node-x", "driver": "d.example"}
    assert _get(s, "vgpu_dra_prepared_claims", **base) == 2
    assert _get(s, "nvidia_dra_prepared_devices", device_type="gpu", **base) == 1
    assert _get(s, "nvidia_dra_prepared_devices", device_type="partition", **base) == 2

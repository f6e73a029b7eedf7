"""The kubelet-facing gRPC surface: registration, health stream, generated code."""

from __future__ import annotations

import filecmp
import importlib
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from driver.kubelet import MAX_HEALTH_STREAMS
from driver.proto.generate import PROTOS, generate
from tests.driver.kubelet_standin import (
    DRIVER,
    KubeletStandin,
    allocated_claim,
    claim_id,
    result,
)
from tests.driver.plugin_process import InProcessPlugin
from tests.fakes.apiserver import FakeApiServer

PROTO_DIR = Path(__file__).resolve().parents[2] / "driver" / "proto"


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vgk", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as s:
        yield s


def test_get_info_advertises_dra_socket_and_versions(root: Path, server: FakeApiServer) -> None:
    plugin = InProcessPlugin(root, server.api_client())
    plugin.driver.start()
    try:
        kubelet = KubeletStandin(plugin.registration_socket)
        assert plugin.registration_socket == root / "registry" / f"{DRIVER}-reg.sock"
        info = kubelet.register()
        assert info.type == "DRAPlugin"
        assert info.name == DRIVER
        assert info.endpoint == str(root / "plugins" / DRIVER / "dra.sock")
        assert list(info.supported_versions) == [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        ]
        assert plugin.driver.plugin.registered.wait(5)
        kubelet.close()
    finally:
        plugin.driver.stop()
    # A clean stop removes both sockets so the kubelet deregisters the plugin.
    assert not (root / "registry" / f"{DRIVER}-reg.sock").exists()
    assert not (root / "plugins" / DRIVER / "dra.sock").exists()


def test_rejected_registration_is_retried(root: Path, server: FakeApiServer) -> None:
    plugin = InProcessPlugin(root, server.api_client(), registration_backoff=(0.1, 0.2))
    plugin.driver.start()
    try:
        kubelet = KubeletStandin(plugin.registration_socket)
        kubelet.register(accept=False, error="version mismatch")
        assert not plugin.driver.plugin.registered.is_set()
        sock = plugin.registration_socket
        # The plugin re-creates its registration socket; the kubelet then registers it again.
        for _ in range(100):
            if plugin.driver.plugin.registration_attempts >= 2 and sock.exists():
                break
            threading.Event().wait(0.05)
        # (Not compared by inode: the file system may hand the new socket the old number.)
        assert plugin.driver.plugin.registration_attempts >= 2
        kubelet.register(accept=True)
        assert plugin.driver.plugin.registered.is_set()
        kubelet.close()
    finally:
        plugin.driver.stop()


def test_health_stream_full_list_at_start_and_on_change(root: Path, server: FakeApiServer) -> None:
    plugin = InProcessPlugin(root, server.api_client())
    plugin.driver.start()
    kubelet = KubeletStandin(plugin.registration_socket)
    kubelet.register()
    got: queue.Queue[dict[str, tuple[str, str]]] = queue.Queue()
    stream = kubelet.watch_health()

    def reader() -> None:
        try:
            for msg in stream:
                got.put(msg)
        except grpc.RpcError:
            pass  # cancelled or server stopped

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        first = got.get(timeout=10)
        # Nobody published before start(): the driver published every GPU as healthy.
        assert first == {
            "gpu-0": ("node-a", "HEALTHY"),
            "gpu-1": ("node-a", "HEALTHY"),
        }
        plugin.health.publish({"gpu-0": "", "gpu-1": "critical XID 79"})
        second = got.get(timeout=10)
        while second == first:  # a periodic re-send of the first list may come in between
            second = got.get(timeout=10)
        assert second == {"gpu-0": ("node-a", "HEALTHY"), "gpu-1": ("node-a", "UNHEALTHY")}
        plugin.health.publish({"gpu-0": "", "gpu-1": "critical XID 79"})  # no change
        plugin.health.publish({"gpu-0": ""})  # a device gone: the full list again
        third = got.get(timeout=10)
        while third == second:  # only periodic re-sends of the same list, never another
            third = got.get(timeout=10)
        assert third == {"gpu-0": ("node-a", "HEALTHY")}
    finally:
        kubelet.close()
        plugin.driver.stop()
        t.join(10)
    assert not t.is_alive()


def test_generated_code_is_current(tmp_path: Path) -> None:
    """Regenerating from the .proto files gives byte-identical modules (nobody hand-edited)."""
    written = generate(tmp_path)
    assert len(written) == 2 * len(PROTOS)
    for path in written:
        committed = PROTO_DIR / path.name
        assert committed.exists(), f"{committed.name} is not committed"
        assert filecmp.cmp(path, committed, shallow=False), f"{path.name} differs: regenerate"


def test_proto_full_method_names() -> None:
    """The method paths the kubelet calls, per the wire contract."""
    from driver.proto import (
        dra_v1_pb2,
        dra_v1beta1_pb2,
        health_v1_pb2,
        health_v1alpha1_pb2,
        pluginregistration_pb2,
    )

    assert dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == (
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    )
    assert dra_v1beta1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == (
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
    )
    assert health_v1alpha1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name == (
        "v1alpha1.DRAResourceHealth"
    )
    assert health_v1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name == (
        "v1.DRAResourceHealth"
    )
    assert pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"].full_name == (
        "pluginregistration.Registration"
    )
    dev = dra_v1_pb2.Device.DESCRIPTOR.fields_by_name
    assert {f: dev[f].number for f in dev} == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    }
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name
    for pb in (health_v1_pb2, health_v1alpha1_pb2):
        h = pb.DeviceHealth.DESCRIPTOR.fields_by_name
        assert {f: h[f].number for f in h} == {
            "device": 1,
            "health": 2,
            "last_updated_time": 3,
            "health_check_timeout_seconds": 4,
            "message": 5,
        }


def test_socket_path_too_long_is_a_clear_error(server: FakeApiServer) -> None:
    root = Path(tempfile.mkdtemp(prefix="vgk", dir="/tmp"))
    deep = root / ("d" * 60) / ("e" * 60)
    try:
        plugin = InProcessPlugin(deep, server.api_client())
        with pytest.raises(ValueError, match=r"unix sockets allow at most 107"):
            plugin.driver.start()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_open_health_streams_do_not_starve_prepare(root: Path, server: FakeApiServer) -> None:
    """Sixteen (here twenty) open health streams once took every worker of the DRA server, and
    prepare timed out. Streams beyond the bound are refused; prepare is still answered."""
    plugin = InProcessPlugin(root, server.api_client())
    plugin.driver.start()
    # Starved, prepare never completes; 30 s keeps a loaded machine from passing for starved.
    kubelet = KubeletStandin(plugin.registration_socket, timeout=30)
    kubelet.register()
    assert kubelet.info is not None
    channel = grpc.insecure_channel(f"unix://{kubelet.info.endpoint}")
    pb = importlib.import_module("driver.proto.health_v1alpha1_pb2")
    stub = importlib.import_module("driver.proto.health_v1alpha1_pb2_grpc").DRAResourceHealthStub(
        channel
    )
    streams = [
        stub.NodeWatchResources(pb.NodeWatchResourcesRequest(), timeout=30) for _ in range(20)
    ]
    try:
        opened = refused = 0
        for s in streams:
            try:
                next(s)
                opened += 1
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert "health streams already open" in (e.details() or "")
                refused += 1
        assert (opened, refused) == (MAX_HEALTH_STREAMS, 20 - MAX_HEALTH_STREAMS)
        c = claim_id(server.put(allocated_claim("c1", results=[result("gpu", "gpu-0")])))
        assert kubelet.prepare([c])[c.uid].error == ""
        assert kubelet.unprepare([c]) == {c.uid: ""}
        # A closed stream frees its slot for the next one.
        streams[0].cancel()
        deadline = time.monotonic() + 60  # a liveness bound (a slot never freed), not a speed one
        while True:
            again = stub.NodeWatchResources(pb.NodeWatchResourcesRequest(), timeout=30)
            try:
                next(again)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "a cancelled stream kept its slot"
                time.sleep(0.2)
        streams.append(again)
    finally:
        for s in streams:
            s.cancel()
        channel.close()
        kubelet.close()
        plugin.driver.stop()

"""The plugin's wiring in-process: Settings -> API -> discovery -> mode -> Driver -> slices/health.

NVML is the scriptable facade (tests/fakes/nvml.py); the API server is the fake one over real
HTTP; the Driver is the real one with its real gRPC sockets. The subprocess end-to-end test
(the console script on the simulator, SIGTERM) is test_main_e2e.py.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from driver.backoff import Backoff
from driver.discovery import XidEvent
from driver.flags import Settings, parse
from driver.main import (
    EXIT_MODE_CHANGED,
    EXIT_OK,
    EXIT_STARTUP,
    EXIT_USAGE,
    Plugin,
    evict_blind,
    main,
)
from sharing.claimlayout import MODE_FILE
from sharing.gpus import GpuInfo
from sharing.policy import SharingPolicy, from_document
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.nvml import FakeNvml

NODE = "node-a"
DRIVER = "vgpu.sharing.dev"


def gpu(index: int) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA H100 80GB HBM3",
        memory_total=80 * 1024**3,
        memory_used=0,
        pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
        minor=index,
        numa_node=0,
        compute_capability="9.0",
        driver_version="550.54.15",
        cuda_driver_version="12.4",
    )


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # Unix socket paths must stay under ~107 bytes; pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="vgpu-main-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@dataclass
class Running:
    plugin: Plugin
    thread: threading.Thread
    result: list[int]

    def stop(self, timeout: float = 20.0) -> int:
        self.plugin.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "plugin did not stop"
        return self.result[0]


def settings(server: FakeApiServer, root: Path, *extra: str) -> Settings:
    kubeconfig = server.kubeconfig_path(root)
    return parse(
        [
            "--node-name",
            NODE,
            "--kubeconfig",
            str(kubeconfig),
            "--cdi-root",
            str(root / "cdi"),
            "--kubelet-registrar-directory-path",
            str(root / "reg"),
            "--kubelet-plugins-directory-path",
            str(root / "plugins"),
            "--data-dir",
            str(root / "data"),
            "--rediscover-interval",
            "200ms",
            "--healthcheck-port",
            "0",
            *extra,
        ],
        env={},
    )


def start(s: Settings, nvml: FakeNvml) -> Running:
    plugin = Plugin(s, backend=nvml, backoff=Backoff(0.05, 2.0, 0.2), resync=60)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(plugin.run()), daemon=True)
    t.start()
    return Running(plugin, t, result)


def device_names(server: FakeApiServer) -> list[str]:
    return [
        d["name"] for s in server.objects("ResourceSlice") for d in s["spec"].get("devices") or []
    ]


def wait_devices(server: FakeApiServer, names: list[str], timeout: float = 15.0) -> None:
    server.wait_for(lambda s: device_names(s) == names, timeout, f"devices {names}")


def wait_taints(server: FakeApiServer, want: dict[str, str | None], timeout: float = 15.0) -> None:
    """Until the pool's devices are `want`: device name -> its unhealthy taint's value or None."""

    def taints(s: FakeApiServer) -> dict[str, str | None]:
        return {
            d["name"]: (d["taints"][0]["value"] if d.get("taints") else None)
            for sl in s.objects("ResourceSlice")
            for d in sl["spec"].get("devices") or []
        }

    server.wait_for(lambda s: taints(s) == want, timeout, f"taints {want}")


def healthz(plugin: Plugin) -> tuple[int, dict[str, Any]]:
    assert plugin.healthz is not None
    url = f"http://127.0.0.1:{plugin.healthz.port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_until(pred: Any, timeout: float = 15.0, what: str = "condition") -> None:
    ev = threading.Event()
    deadline = 0.0
    while deadline < timeout:
        if pred():
            return
        ev.wait(0.05)
        deadline += 0.05
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as s:
        s.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield s


@pytest.mark.slow
def test_publishes_serves_and_follows_health(server: FakeApiServer, short_tmp: Path) -> None:
    nvml = FakeNvml([gpu(0), gpu(1)])
    # A critical XID holds until the rediscovery round after the next (between one and two
    # intervals): the test must see the taint and the health stream within that, so the interval
    # is 2 s here (at 200 ms a loaded machine let the health stream recover before it was read).
    run = start(settings(server, short_tmp, "--rediscover-interval", "2s"), nvml)
    try:
        wait_devices(server, ["gpu-0", "gpu-1"])
        p = run.plugin
        assert p.mode == "sharing"
        assert (short_tmp / "data" / MODE_FILE).read_text().strip() == "sharing"
        # The Driver's sockets are up and /healthz says so.
        assert (short_tmp / "reg" / f"{DRIVER}-reg.sock").exists()
        assert (short_tmp / "plugins" / DRIVER / "dra.sock").exists()
        code, body = healthz(p)
        assert code == 200 and body["live"] is True
        assert body["grpc"] == {"registration": True, "dra": True}
        assert body["registered"] is False  # no kubelet here
        assert body["mode"] == "sharing" and body["apiServerReachable"] is True
        # A critical XID: the device is tainted and the health stream says unhealthy.
        gen = server.objects("ResourceSlice")[0]["spec"]["pool"]["generation"]
        nvml.inject(XidEvent("GPU-1", 79))
        wait_taints(server, {"gpu-0": None, "gpu-1": "xid-79"})
        assert server.objects("ResourceSlice")[0]["spec"]["pool"]["generation"] > gen
        assert p.driver is not None
        wait_until(
            lambda: (
                {d.device: (d.healthy, d.message) for d in p.driver.health.snapshot().devices}
                == {"gpu-0": (True, ""), "gpu-1": (False, "critical XID 79")}
            ),
            what="health stream",
        )
        # It recovers; then it disappears from NVML altogether: lost, still listed, tainted.
        wait_taints(server, {"gpu-0": None, "gpu-1": None})
        nvml.gpus = [gpu(0)]
        wait_taints(server, {"gpu-0": None, "gpu-1": "gpu-lost"})
        wait_until(
            lambda: (
                {d.device: d.healthy for d in p.driver.health.snapshot().devices}
                == {"gpu-0": True, "gpu-1": False}
            ),
            what="gpu-1 lost on the health stream",
        )
        # GPUs that appear later (gpu-1 back, gpu-2 new) are offered, and the Driver knows them
        # first so that claims on them can be prepared.
        nvml.gpus = [gpu(0), gpu(1), gpu(2)]
        wait_devices(server, ["gpu-0", "gpu-1", "gpu-2"])
        assert [g.index for g in p.driver.gpus] == [0, 1, 2]
    finally:
        assert run.stop() == EXIT_OK
    # No --cleanup: the slices stay, the sockets are gone.
    assert device_names(server) == ["gpu-0", "gpu-1", "gpu-2"]
    assert not (short_tmp / "plugins" / DRIVER / "dra.sock").exists()


def test_cleanup_deletes_slices_on_shutdown(server: FakeApiServer, short_tmp: Path) -> None:
    run = start(settings(server, short_tmp, "--cleanup"), FakeNvml([gpu(0)]))
    wait_devices(server, ["gpu-0"])
    assert run.stop() == EXIT_OK
    assert server.objects("ResourceSlice") == []


@pytest.mark.slow
def test_auto_switches_to_partition_when_server_drops_fields(short_tmp: Path) -> None:
    with FakeApiServer(drop_consumable_capacity=True) as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        run = start(settings(server, short_tmp, "--partitions", "2"), FakeNvml([gpu(0)]))
        try:
            wait_devices(server, ["gpu-0-slice-0", "gpu-0-slice-1"])
            assert run.plugin.mode == "partition"
            assert run.plugin.driver is not None and run.plugin.driver.mode == "partition"
            assert (short_tmp / "data" / MODE_FILE).read_text().strip() == "partition"
        finally:
            assert run.stop() == EXIT_OK


@pytest.mark.slow
def test_api_down_at_start_with_remembered_mode_serves_then_publishes(
    server: FakeApiServer, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    (short_tmp / "data").mkdir()
    (short_tmp / "data" / MODE_FILE).write_text("sharing\n")
    server.down()
    run = start(settings(server, short_tmp), FakeNvml([gpu(0)]))
    try:
        # The gRPC sockets come up without the API server.
        wait_until(lambda: run.plugin.healthz is not None, what="healthz")
        wait_until(lambda: healthz(run.plugin)[0] == 200, what="live without API server")
        wait_until(
            lambda: any("retrying in" in r.getMessage() for r in caplog.records), what="a retry log"
        )
        assert healthz(run.plugin)[1]["apiServerReachable"] is False
        server.up()
        wait_devices(server, ["gpu-0"])
        wait_until(lambda: healthz(run.plugin)[1]["apiServerReachable"] is True, what="reachable")
    finally:
        assert run.stop() == EXIT_OK


def test_api_down_at_first_start_waits_and_stops_promptly(
    server: FakeApiServer, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server.down()
    run = start(settings(server, short_tmp), FakeNvml([gpu(0)]))
    wait_until(
        lambda: sum("retrying in" in r.getMessage() for r in caplog.records) >= 2,
        what="retries with backoff",
    )
    assert run.plugin.driver is None  # no mode yet: no sockets
    assert run.stop() == EXIT_OK


def test_mode_change_under_a_running_plugin_exits_3(short_tmp: Path) -> None:
    with FakeApiServer(drop_consumable_capacity=True) as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        (short_tmp / "data").mkdir()
        (short_tmp / "data" / MODE_FILE).write_text("sharing\n")
        run = start(settings(server, short_tmp), FakeNvml([gpu(0)]))
        run.thread.join(20)
        assert not run.thread.is_alive()
        assert run.result == [EXIT_MODE_CHANGED]
        assert (short_tmp / "data" / MODE_FILE).read_text().strip() == "partition"


def test_nvml_failure_at_start_is_a_clear_error(
    server: FakeApiServer, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml([gpu(0)])
    nvml.broken = RuntimeError("NVML Shared Library Not Found")
    run = start(settings(server, short_tmp), nvml)
    run.thread.join(20)
    assert run.result == [EXIT_STARTUP]
    assert any("NVML: cannot list GPUs" in r.getMessage() for r in caplog.records)


def test_corrupt_checkpoint_is_one_log_line_not_a_traceback(
    server: FakeApiServer, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/driver-kubelet.md promises one line naming the file and the fault."""
    (short_tmp / "data").mkdir()
    checkpoint = short_tmp / "data" / "checkpoint.json"
    checkpoint.write_text('{"version": 1, "checksum": "sha256:0", "claims": {}}')
    run = start(settings(server, short_tmp, "--sharing-mode", "sharing"), FakeNvml([gpu(0)]))
    run.thread.join(20)
    assert run.result == [EXIT_STARTUP]
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.exc_info is None  # no traceback
    assert record.getMessage() == (
        f"checkpoint {checkpoint} is corrupt: checksum sha256:0 does not match the content "
        f"(sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a); move it "
        "aside to start without the claims it records"
    )


def test_bad_flag_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--node-name", "n", "--partitions", "zero"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("vgpu-kubelet-plugin: error: --partitions: 'zero' is not an integer")


def test_missing_kubeconfig_is_a_startup_error(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = parse(
        [
            "--node-name",
            NODE,
            "--kubeconfig",
            str(short_tmp / "nope"),
            "--data-dir",
            str(short_tmp),
        ],
        env={},
    )
    assert Plugin(s, backend=FakeNvml([gpu(0)])).run() == EXIT_STARTUP
    assert any("cannot load kubeconfig" in r.getMessage() for r in caplog.records)


def test_in_cluster_config_outside_a_cluster_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from driver.kube import KubeConfigError, make_api_client

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeConfigError) as e:
        make_api_client(None)
    assert "in-cluster configuration" in str(e.value) and "--kubeconfig" in str(e.value)
    assert "\n" not in str(e.value)


def test_api_client_does_not_retry_behind_the_backoff(
    server: FakeApiServer, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from driver.kube import Kube, make_api_client

    kube = Kube(make_api_client(server.kubeconfig_path(short_tmp)))
    assert kube.read_node(NODE)["metadata"]["name"] == NODE
    server.down()
    caplog.set_level(logging.DEBUG, logger="urllib3")
    with pytest.raises(Exception, match=r"(?i)refused|max retries"):
        kube.list_slices("spec.nodeName=x")
    # urllib3 logs each hidden retry; the publisher's own backoff is the only retry wanted.
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


@pytest.mark.slow
def test_server_losing_consumable_capacity_at_runtime_exits_3(short_tmp: Path) -> None:
    with FakeApiServer() as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        plugin = Plugin(
            settings(server, short_tmp),
            backend=FakeNvml([gpu(0)]),
            backoff=Backoff(0.05, 2.0, 0.2),
            resync=0.2,
            reprobe=0.2,
        )
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(plugin.run()), daemon=True)
        t.start()
        wait_devices(server, ["gpu-0"])
        assert t.is_alive() and plugin.mode == "sharing"
        server.drop_consumable_capacity = True
        t.join(20)
        assert not t.is_alive()
        assert result == [EXIT_MODE_CHANGED]
        assert (short_tmp / "data" / MODE_FILE).read_text().strip() == "partition"


def test_healthcheck_port_in_use_is_a_startup_error(
    server: FakeApiServer, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        s = settings(server, short_tmp, "--healthcheck-port", str(port))
        assert Plugin(s, backend=FakeNvml([gpu(0)])).run() == EXIT_STARTUP
    assert any(f"--healthcheck-port {port}: cannot listen" in m for m in caplog.messages)
    # The Driver it had started is stopped again: no sockets left behind.
    assert not (short_tmp / "plugins" / DRIVER / "dra.sock").exists()


def _policy(default: dict[str, Any], *overrides: dict[str, Any]) -> SharingPolicy:
    return from_document(
        {
            "apiVersion": "vgpu.sharing.dev/v1alpha1",
            "kind": "SharingPolicy",
            "default": default,
            "overrides": [{"match": {"modelName": "*"}, **o} for o in overrides],
        }
    )


@pytest.mark.parametrize(
    ("default", "overrides", "host_pid", "blind"),
    [
        ({}, [], False, False),  # the built-in: nothing bursts
        ({"burst": {"maxRatio": 2}}, [], True, False),  # hostPID: the plugin sees the borrowers
        ({"burst": {"maxRatio": 2}}, [], False, True),  # evict is the built-in reclaim
        ({"burst": {"maxRatio": 2, "reclaim": "wait"}}, [], False, False),  # wait needs no /proc
        ({}, [{"burst": {"maxRatio": 4, "reclaim": "evict"}}], False, True),  # in an override
    ],
)
def test_a_policy_that_evicts_borrowers_the_plugin_cannot_see_is_told_apart(
    default: dict[str, Any], overrides: list[dict[str, Any]], host_pid: bool, blind: bool
) -> None:
    """Outside the host's PID namespace the plugin finds no borrower's process in /proc: a
    policy whose reclaim is evict then cannot notify or stop anyone (the plugin warns at start
    and at every reload)."""
    assert evict_blind(_policy(default, *overrides), host_pid) is blind

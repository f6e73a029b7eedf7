"""`vgpu exporter`: real HTTP scrapes of real slices (tenants under the shim on the simulator),
claims that come and go in the plugin's data directory, and NVML that hangs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sharing import region
from sharing.observe.exporter import (
    DEFAULT_PORT,
    Exporter,
    ExporterConfig,
    ListenError,
    parse_listen,
)
from sharing.observe.metrics import SLICE_LABELS
from sharing.observe.nvml_reader import GpuProcess, GpuReading, NvmlReading
from sharing.paths import shim_library
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.observers import (
    ExporterProcess,
    MiB,
    Sample,
    add_claim,
    only,
    region_with_limits,
    scrape,
    scrape_until,
    start_tenant,
    value,
)
from tests.support.shim_ops import Held

GiB = 1 << 30
SLICE_METRICS = (
    "vgpu_slice_memory_limit_bytes",
    "vgpu_slice_memory_used_bytes",
    "vgpu_slice_memory_peak_bytes",
    "vgpu_slice_compute_limit_ratio",
    "vgpu_slice_compute_used_ratio",
    "vgpu_slice_throttled_seconds_total",
    "vgpu_slice_launches_total",
    "vgpu_slice_alloc_denied_total",
    "vgpu_slice_alloc_denied_bytes_total",
    "vgpu_slice_processes",
    "vgpu_slice_processes_without_shim",
    "vgpu_slice_quota_violations_total",
)
DEVICE_METRICS = (
    "vgpu_device_memory_total_bytes",
    "vgpu_device_memory_used_bytes",
    "vgpu_device_utilization_ratio",
    "vgpu_device_slices",
    "vgpu_device_memory_allocated_bytes",
    "vgpu_device_cores_allocated_ratio",
    "vgpu_device_healthy",
)


def test_listen_parsing() -> None:
    assert parse_listen(":9402") == ("0.0.0.0", 9402)
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:9402") == ("::1", 9402)
    for bad in ("9402x", "host", "h:70000", "h:-1"):
        with pytest.raises(ListenError, match="expected HOST:PORT"):
            parse_listen(bad)


# Inputs of `vgpu exporter --listen`, `vgpu demo --listen` (no default port) and the plugin's
# --metrics-address (a HOST alone means DEFAULT_PORT): one parser, so one answer for each.
LISTEN_CASES: list[tuple[str, tuple[str, int] | None, tuple[str, int] | None]] = [
    # text, without a default port, with DEFAULT_PORT (None: refused)
    (":9402", ("0.0.0.0", 9402), ("0.0.0.0", 9402)),
    ("127.0.0.1:0", ("127.0.0.1", 0), ("127.0.0.1", 0)),
    ("[::1]:9000", ("::1", 9000), ("::1", 9000)),
    ("host:65535", ("host", 65535), ("host", 65535)),
    ("host", None, ("host", DEFAULT_PORT)),
    ("0.0.0.0", None, ("0.0.0.0", DEFAULT_PORT)),
    ("::1", None, ("::1", DEFAULT_PORT)),  # a bare IPv6 address: its last group is no port
    ("[::1]", None, ("::1", DEFAULT_PORT)),
    ("h:70000", None, None),
    ("h:-1", None, None),
    ("h:x1", None, None),
    ("h:", None, None),
    ("", None, None),
]


@pytest.mark.parametrize(("text", "alone", "defaulted"), LISTEN_CASES)
def test_listen_rules_of_both_callers(
    text: str, alone: tuple[str, int] | None, defaulted: tuple[str, int] | None
) -> None:
    from driver.flags import SettingsError, parse

    for default, want in ((None, alone), (DEFAULT_PORT, defaulted)):
        if want is None:
            with pytest.raises(ListenError, match="expected HOST:PORT") as e:
                parse_listen(text, default)
            assert "\n" not in str(e.value)
        else:
            assert parse_listen(text, default) == want
    if not text:
        return  # the plugin's empty --metrics-address: no endpoint (test_plugin_metrics_flags)
    argv = ["--node-name", "n", "--metrics-address", text]
    if defaulted is None:
        with pytest.raises(SettingsError, match=r"--metrics-address: .*expected HOST:PORT"):
            parse(argv, env={})
    else:
        assert parse(argv, env={}).metrics_address == defaulted


@pytest.mark.slow
def test_two_tenants_on_the_simulator(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path]
) -> None:
    a, b = tmp_path / "team-a.region", tmp_path / "team-b.region"
    region_with_limits(a, 1 * GiB, 30)
    region_with_limits(b, 2 * GiB, 60)
    exp = ExporterProcess(
        ["--sim", "--data-dir", str(tmp_path / "no-plugin"), "--region", str(a), "--region", str(b),
         "--hostname", "node-1"],
        sim_env,
    )  # fmt: skip
    try:
        work = ["--chunk-mib", "256", "--max-chunks", "16", "--seconds", "4"]
        tenants = [
            start_tenant(sim_env, a, "1Gi", 30, *work),
            start_tenant(sim_env, b, "2Gi", 50, *work),
        ]
        mid: list[float] = []
        while any(t.poll() is None for t in tenants):
            time.sleep(1.2)
            s = scrape(exp.url)
            mid += [x.value for x in only(s, "vgpu_slice_compute_used_ratio", claim=str(a))]
        for t in tenants:
            _, err = t.communicate(timeout=30)
            assert t.returncode == 0, err
        # a process that holds memory in team-a's slice while we look
        shim_env = dict(sim_env, LD_PRELOAD=str(shim_library()),
                        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(a))  # fmt: skip
        held = Held(build_c("shim_ops.c"), shim_env, "init", "ctx", f"alloc:{100 * MiB}")
        try:
            # The exposition may be a read taken between the process's start (its slot: one
            # process) and its allocation: wait for one that has both.
            def holding(s: list[Sample]) -> bool:
                procs = only(s, "vgpu_slice_processes", claim=str(a))
                used = only(s, "vgpu_slice_memory_used_bytes", claim=str(a))
                mine = 100 * MiB + CONTEXT_MEMORY  # its allocation and its context
                return bool(procs and used) and procs[0].value == 1 and used[0].value == mine

            s = scrape_until(exp.url, holding)
        finally:
            held.release()
    finally:
        log = exp.stop()
    assert "Traceback" not in log, log

    assert value(s, "vgpu_build_info", region_layout=str(region.LAYOUT_VERSION)) == 1
    for name in DEVICE_METRICS:
        assert only(s, name, gpu="0", Hostname="node-1"), name
    uuid = only(s, "vgpu_device_healthy", gpu="0")[0].labels["UUID"]
    assert uuid.startswith("GPU-")
    assert value(s, "vgpu_device_healthy", gpu="0") == 1
    assert value(s, "vgpu_device_slices", gpu="0") == 2
    assert value(s, "vgpu_device_memory_allocated_bytes", gpu="0") == 3 * GiB
    assert value(s, "vgpu_device_cores_allocated_ratio", gpu="0") == pytest.approx(0.8)
    assert value(s, "vgpu_device_memory_total_bytes", gpu="0") > 3 * GiB

    for name in SLICE_METRICS:
        series = only(s, name)
        assert len(series) >= 2, name
        for x in series:  # one label set for every slice series: they join one-to-one
            assert set(x.labels) == set(SLICE_LABELS), (name, x.labels)
    ka, kb = {"claim": str(a), "UUID": uuid}, {"claim": str(b), "UUID": uuid}
    assert value(s, "vgpu_slice_memory_limit_bytes", **ka) == 1 * GiB
    assert value(s, "vgpu_slice_memory_limit_bytes", **kb) == 2 * GiB
    assert value(s, "vgpu_slice_compute_limit_ratio", **ka) == pytest.approx(0.3)
    assert value(s, "vgpu_slice_compute_limit_ratio", **kb) == pytest.approx(0.5)
    # each tenant's context took its share; then it got 2 (resp. 6) x 256 MiB, and one 256 MiB
    # allocation was refused
    for k, quota in ((ka, 1 * GiB), (kb, 2 * GiB)):
        n = (quota - CONTEXT_MEMORY) // (256 * MiB)
        assert value(s, "vgpu_slice_alloc_denied_total", **k) == 1
        assert value(s, "vgpu_slice_alloc_denied_bytes_total", **k) == 256 * MiB
        assert value(s, "vgpu_slice_memory_peak_bytes", **k) == CONTEXT_MEMORY + n * 256 * MiB
        assert value(s, "vgpu_slice_launches_total", **k) > 0
        assert value(s, "vgpu_slice_throttled_seconds_total", **k) > 0  # back to back: held back
    assert value(s, "vgpu_slice_memory_used_bytes", **ka) == 100 * MiB + CONTEXT_MEMORY
    assert value(s, "vgpu_slice_processes", **ka) == 1
    assert value(s, "vgpu_slice_memory_used_bytes", **kb) == 0
    assert value(s, "vgpu_slice_processes", **kb) == 0
    # while it ran, team-a's achieved share was seen, and not far above its 30 % cap
    assert any(r > 0 for r in mid), mid
    assert max(mid) < 0.5, mid
    assert value(s, "vgpu_exporter_scrape_duration_seconds") > 0


# ---- the plugin's data directory, in process, with NVML stood in ----------------------------

UUID0, UUID1 = (
    "GPU-00000000-0000-0000-0000-000000000000",
    "GPU-11111111-1111-1111-1111-111111111111",
)


def _gpus(procs: tuple[GpuProcess, ...] = ()) -> NvmlReading:
    g = [
        GpuReading(i, u, "NVIDIA H100 80GB HBM3", f"00000000:0{i}:00.0", True, 80 * GiB, GiB, 0.5,
                   procs if i == 0 else ())
        for i, u in enumerate((UUID0, UUID1))
    ]  # fmt: skip
    r = NvmlReading(taken=time.monotonic(), gpus=tuple(g))
    r.by_uuid.update({x.uuid: x for x in g})
    return r


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Exporter, str, Path]]:
    data = tmp_path / "data"
    data.mkdir()
    cfg = ExporterConfig(data_dir=data, hostname="node-a", cache_seconds=0)  # read at every scrape
    exp = Exporter(cfg, nvml_reader=_gpus)
    host, port = exp.start("127.0.0.1", 0)
    try:
        yield exp, f"http://{host}:{port}", data
    finally:
        exp.stop()


def test_claims_appear_and_disappear_without_restart(served: tuple[Exporter, str, Path]) -> None:
    _, url, data = served
    assert only(scrape(url), "vgpu_slice_memory_limit_bytes") == []
    assert value(scrape(url), "vgpu_device_slices", gpu="1") == 0
    c1 = add_claim(data, "uid-1", "train", UUID1, 8 * GiB, 25, device=("node-a", "gpu-1"))
    s = scrape(url)
    # ours, and dcgm-exporter's: both spellings of the host, its pod and DRA labels
    lab = {"claim_uid": "uid-1", "namespace": "team", "claim": "train", "pod": "", "gpu": "1",
           "UUID": UUID1, "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node-a",
           "hostname": "node-a", "pci_bus_id": "00000000:01:00.0", "container": "",
           "dra_claim_name": "train", "dra_claim_namespace": "team",
           "dra_driver_name": "vgpu.sharing.dev", "dra_pool_name": "node-a",
           "dra_device_name": "gpu-1", "compute_policy": "hard"}  # fmt: skip
    assert only(s, "vgpu_slice_memory_limit_bytes")[0].labels == lab
    assert value(s, "vgpu_slice_memory_limit_bytes", claim_uid="uid-1") == 8 * GiB
    assert value(s, "vgpu_slice_compute_limit_ratio", claim_uid="uid-1") == 0.25
    assert value(s, "vgpu_device_slices", gpu="1") == 1
    assert value(s, "vgpu_device_cores_allocated_ratio", gpu="1") == 0.25
    add_claim(data, "uid-2", "infer", UUID1, 4 * GiB, 50)
    s = scrape(url)
    assert value(s, "vgpu_device_memory_allocated_bytes", gpu="1") == 12 * GiB
    # unprepare removes the claim's directory: the slice goes with it
    for f in c1.iterdir():
        f.unlink()
    c1.rmdir()
    s = scrape(url)
    assert [x.labels["claim_uid"] for x in only(s, "vgpu_slice_memory_limit_bytes")] == ["uid-2"]
    assert value(s, "vgpu_device_slices", gpu="1") == 1


def test_every_slice_series_says_the_compute_policy_the_slice_runs_under(
    served: tuple[Exporter, str, Path],
) -> None:
    """Issue 33 part 4: a claim whose own config switched its cap off ran uncapped and nothing
    said so. Every per-slice series now carries `compute_policy`, its limits file's (the one
    the shim enforces): an uncapped slice is one query away (`compute_policy="off"`)."""
    _, url, data = served
    add_claim(data, "uid-h", "capped", UUID1, GiB, 10)
    add_claim(data, "uid-e", "borrowing", UUID1, GiB, 20, policy="elastic")
    add_claim(data, "uid-o", "uncapped", UUID1, GiB, 10, policy="off")
    s = scrape(url)
    for name in SLICE_METRICS:
        policies = {x.labels["claim_uid"]: x.labels["compute_policy"] for x in only(s, name)
                    if x.labels["claim_uid"]}  # fmt: skip
        assert policies == {"uid-h": "hard", "uid-e": "elastic", "uid-o": "off"}, name
    # the GPU's unattributed violations belong to no slice: no policy
    [unattributed] = only(s, "vgpu_slice_quota_violations_total", claim_uid="")
    assert unattributed.labels["compute_policy"] == ""
    [uncapped] = only(s, "vgpu_slice_compute_limit_ratio", compute_policy="off")
    assert (uncapped.labels["claim"], uncapped.value) == ("uncapped", 0)  # its cap is not held
    assert value(s, "vgpu_slice_compute_limit_ratio", compute_policy="elastic") == 0.2


def test_hostile_claim_directories_do_not_break_a_scrape(
    served: tuple[Exporter, str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A tenant can write in its claim directory: links and FIFOs are not followed or opened,
    an old-layout file is named in one log line, and the other slices are still served."""
    _, url, data = served
    good = add_claim(data, "good", "ok", UUID0, GiB, 10)
    for uid in ("link", "fifo", "old"):
        (data / "claims" / uid / "shared").mkdir(parents=True)
    os.symlink(good / "accounting", data / "claims" / "link" / "shared" / "accounting")
    os.mkfifo(data / "claims" / "fifo" / "shared" / "accounting")
    old = data / "claims" / "old" / "shared" / "accounting"
    blob = bytearray(
        (good / "accounting").read_bytes()[: region.FILE_SIZE - 8 * region.MAX_DEVICES]
    )
    blob[4:8] = (3).to_bytes(4, "little")
    old.write_bytes(bytes(blob))
    with caplog.at_level("WARNING"):
        s = scrape(url)
    assert [x.labels["claim_uid"] for x in only(s, "vgpu_slice_memory_limit_bytes")] == ["good"]
    assert any("layout version 3, this reader knows" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_hung_nvml_never_holds_a_scrape(tmp_path: Path) -> None:
    """After the first pass NVML hangs: scrapes still answer at once, from the last reading,
    and once it is older than stale_after the devices read unhealthy."""
    hang = threading.Event()
    calls = []

    def reader() -> NvmlReading:
        calls.append(1)
        if len(calls) > 1:
            hang.wait(60)
        return _gpus()

    # stale_after leaves a loaded host seconds between the first reading and the first scrape
    cfg = ExporterConfig(data_dir=tmp_path, nvml_interval=0.05, nvml_stale_after=3.0)
    exp = Exporter(cfg, nvml_reader=reader)
    host, port = exp.start("127.0.0.1", 0)
    try:
        url = f"http://{host}:{port}"
        assert value(scrape(url, timeout=5), "vgpu_device_healthy", gpu="0") == 1
        # the poller is stuck inside NVML now; every scrape still answers, and once the last
        # reading is older than stale_after the device reads unhealthy
        s = scrape_until(url, lambda s: value(s, "vgpu_device_healthy", gpu="0") == 0, timeout=60)
        assert len(calls) == 2  # the second call never returned: no third
        assert value(s, "vgpu_device_healthy", gpu="0") == 0
        assert only(s, "vgpu_device_memory_used_bytes") == []  # no frozen numbers
    finally:
        hang.set()
        exp.stop()


def test_defaults_agree_with_the_plugin() -> None:
    """The exporter looks where the plugin writes: both defaults come from sharing.claimlayout."""
    from driver.flags import parse
    from sharing.observe import slices

    assert parse(["--node-name", "n"], env={}).data_dir == slices.DEFAULT_DATA_DIR
    assert parse(["--node-name", "n", "--metrics-address", "0.0.0.0"], env={}).metrics_address == (
        "0.0.0.0",
        9402,
    )


def test_plugin_metrics_flags() -> None:
    from driver.flags import SettingsError, parse

    def addr(text: str) -> tuple[str, int] | None:
        return parse(["--node-name", "n", "--metrics-address", text], env={}).metrics_address

    assert parse(["--node-name", "n"], env={}).metrics_address is None  # off by default
    assert addr(":9402") == ("0.0.0.0", 9402)
    assert addr("[::1]:9000") == ("::1", 9000)
    assert addr("::1") == ("::1", 9402)
    env = {"METRICS_ADDRESS": "127.0.0.1:1", "WATCHDOG_ENFORCE": "kill"}
    s = parse(["--node-name", "n"], env=env)
    assert s.metrics_address == ("127.0.0.1", 1) and s.watchdog_enforce == "kill"
    for bad, msg in (("h:99999", "--metrics-address"), ("h:x1", "--metrics-address")):
        with pytest.raises(SettingsError, match=msg) as e:
            addr(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(SettingsError, match="--watchdog-enforce"):
        parse(["--node-name", "n", "--watchdog-enforce", "maybe"], env={})


def test_cache_is_refreshed_while_scraped(tmp_path: Path) -> None:
    """--cache 1 (the default): the first scrape reads the node; while it is scraped the
    exposition is refreshed in the background, so a new claim shows without a restart. (How
    stale a cached scrape may be is the cache's age bound; timing is not asserted here.)"""
    data = tmp_path / "data"
    data.mkdir()
    exp = Exporter(ExporterConfig(data_dir=data, cache_seconds=1.0), nvml_reader=_gpus)
    host, port = exp.start("127.0.0.1", 0)
    try:
        url = f"http://{host}:{port}"
        assert only(scrape(url), "vgpu_slice_memory_limit_bytes") == []
        add_claim(data, "uid-1", "train", UUID0, GiB, 25)
        s = scrape_until(url, lambda s: bool(only(s, "vgpu_slice_memory_limit_bytes")), 60)
        assert value(s, "vgpu_slice_memory_limit_bytes", claim="train") == GiB
    finally:
        exp.stop()

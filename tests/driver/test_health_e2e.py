"""Device health end to end on the simulator: the `vgpu-kubelet-plugin` process, its DRA socket
(a kubelet's v1 health stream), the fake API server (the ResourceSlice taint) and its metrics
endpoint. An injected critical XID, a lost GPU and NVML not answering each reach the health
stream with their cause, the slice's taint, vgpu_device_healthy / vgpu_nvml_up and, through
promtool with the series as scraped, the alert; recovery clears all of them."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.driver.kubelet_standin import KubeletStandin
from tests.fakes.apiserver import FakeApiServer, free_port
from tests.support.health_watcher import Watcher
from tests.support.observers import Sample, only, scrape
from tests.support.plugin_e2e import (
    DRIVER,
    NODE,
    PluginProcess,
    device,
    devices_of,
    sim_ready,  # noqa: F401 - fixture
    wait_names,
    write_config,
)

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
KEY = f"{DRIVER}/unhealthy"

pytestmark = pytest.mark.slow


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vgh-e2e-", dir="/tmp"))  # short: unix socket paths
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Node:
    """The plugin on the simulator, a kubelet's health stream, the API server, the metrics."""

    def __init__(self, server: FakeApiServer, root: Path) -> None:
        self.server = server
        self.config = root / "simgpu.json"
        write_config(self.config, [device(0), device(1)])
        self.metrics = f"http://127.0.0.1:{free_port()}"
        self.plugin = PluginProcess(
            server, root, "--metrics-address", self.metrics.removeprefix("http://")
        )
        wait_names(server, self.plugin, ["gpu-0", "gpu-1"])
        self.kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        self.kubelet.register()
        assert self.kubelet.info is not None
        self.stream = Watcher(Path(self.kubelet.info.endpoint), "v1")
        self.health: dict[str, tuple[str, str]] = {}

    def close(self) -> int:
        self.stream.close()
        self.kubelet.close()
        return self.plugin.terminate()

    def until(self, what: str, ok: Callable[[], bool], timeout: float = 60) -> None:
        """A liveness bound: the plugin notices within a few 300 ms rounds."""
        deadline = time.monotonic() + timeout
        while not ok():
            if self.plugin.proc.poll() is not None:
                pytest.fail(f"plugin exited:\n{self.plugin.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"never: {what}\n{self.plugin.output()[-3000:]}")
            time.sleep(0.1)

    def stream_shows(self, want: dict[str, tuple[str, str]]) -> bool:
        while not self.stream.got.empty():
            self.health = self.stream.view(self.stream.got.get())
        return self.health == want

    def taints(self) -> dict[str, Any]:
        return {n: d.get("taints") for n, d in devices_of(self.server).items()}

    def samples(self) -> list[Sample]:
        return scrape(self.metrics)


def healthy(s: list[Sample]) -> dict[str, float]:
    return {x.labels["gpu"]: x.value for x in only(s, "vgpu_device_healthy")}


def nvml_up(s: list[Sample]) -> float:
    [x] = only(s, "vgpu_nvml_up")
    return x.value


def _key(x: Sample) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(x.labels.items()))
    return f"{x.name}{{{labels}}}"


def promtool_check(
    phases: list[list[Sample]], expected: list[dict[str, list[dict[str, str]]]], tmp: Path
) -> None:
    """promtool evaluates the shipped alerts (expr, for, labels; annotations left out) on the
    series as scraped, each phase's scrape held for 3 minutes; at the end of phase i,
    expected[i] maps an alert name to the label sets it must fire with (none: silent)."""
    wanted = ("vgpu_device_healthy", "vgpu_nvml_up")
    keys = sorted({_key(x) for s in phases for name in wanted for x in only(s, name)})
    values: dict[str, list[str]] = {k: [] for k in keys}
    for s in phases:
        now = {_key(x): x.value for name in wanted for x in only(s, name)}
        for k in keys:
            values[k] += [str(int(now[k])) if k in now else "_"] * 3
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rules))
    alerts = sorted({a for e in expected for a in e})
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": k, "values": " ".join(v)} for k, v in values.items()],
                "alert_rule_test": [
                    {
                        "eval_time": f"{3 * i + 2}m",
                        "alertname": a,
                        "exp_alerts": [{"exp_labels": lab} for lab in e.get(a, [])],
                    }
                    for i, e in enumerate(expected)
                    for a in alerts
                ],
            }
        ],
    }
    (tmp / "test.yaml").write_text(yaml.safe_dump(test))
    r = subprocess.run(
        ["promtool", "test", "rules", "test.yaml"], cwd=tmp, capture_output=True, text=True
    )
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"


def labels_of(s: list[Sample], gpu: str, severity: str = "warning") -> dict[str, str]:
    [x] = only(s, "vgpu_device_healthy", gpu=gpu)
    return {**x.labels, "severity": severity}


@pytest.mark.usefixtures("sim_ready")
def test_xid_lost_gpu_and_nvml_down_reach_stream_taint_metric_and_alert(
    root: Path, tmp_path: Path
) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("no promtool (apt package prometheus)")
    with FakeApiServer(validate_versions=("1.36", "1.37")) as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        n = Node(server, root)
        try:
            ok = {"gpu-0": ("HEALTHY", ""), "gpu-1": ("HEALTHY", "")}
            n.until("both healthy on the stream", lambda: n.stream_shows(ok))
            n.until("metrics for both GPUs", lambda: healthy(n.samples()) == {"0": 1, "1": 1})
            phases = [n.samples()]

            # An injected critical XID on GPU 1.
            write_config(n.config, [device(0), device(1, healthy=False) | {"xid": 79}])
            xid = {"gpu-0": ("HEALTHY", ""), "gpu-1": ("UNHEALTHY", "critical XID 79")}
            n.until("XID 79 on the stream", lambda: n.stream_shows(xid))
            taint = [{"key": KEY, "value": "xid-79", "effect": "NoSchedule"}]
            n.until("the taint", lambda: n.taints() == {"gpu-0": None, "gpu-1": taint})
            n.until("the metric", lambda: healthy(n.samples()) == {"0": 1, "1": 0})
            phases.append(n.samples())

            # Recovery.
            write_config(n.config, [device(0), device(1)])
            n.until("recovered on the stream", lambda: n.stream_shows(ok))
            n.until("no taint", lambda: n.taints() == {"gpu-0": None, "gpu-1": None})
            n.until("metric back", lambda: healthy(n.samples()) == {"0": 1, "1": 1})
            phases.append(n.samples())

            # GPU 1 falls off the bus: NVML no longer lists it.
            write_config(n.config, [device(0)])
            lost = {"gpu-0": ("HEALTHY", ""), "gpu-1": ("UNHEALTHY", "GPU lost: NVML no longer reports it")}  # fmt: skip
            n.until("lost on the stream", lambda: n.stream_shows(lost))
            taint = [{"key": KEY, "value": "gpu-lost", "effect": "NoSchedule"}]
            n.until("lost taint", lambda: n.taints() == {"gpu-0": None, "gpu-1": taint})
            n.until("lost metric", lambda: healthy(n.samples()) == {"0": 1, "1": 0})
            phases.append(n.samples())

            # NVML stops answering (the simulator's config unreadable: nvmlInit fails).
            write_config(n.config, [device(0), device(1)])
            n.until("back", lambda: n.stream_shows(ok))
            n.config.write_text("{not json")

            def nvml_down() -> bool:
                n.stream_shows({})  # takes in what arrived
                causes = list(n.health.values())
                return len(causes) == 2 and all(
                    h == "UNHEALTHY" and m.startswith("NVML unreachable: ") for h, m in causes
                )

            n.until("NVML unreachable on the stream", nvml_down)
            n.until(
                "nvml-unreachable taints",
                lambda: (
                    {t[0]["value"] for t in n.taints().values() if t} == {"nvml-unreachable"}
                    and all(n.taints().values())
                ),
            )
            n.until("vgpu_nvml_up 0", lambda: nvml_up(n.samples()) == 0)
            assert healthy(n.samples()) == {"0": 0, "1": 0}
            phases.append(n.samples())

            write_config(n.config, [device(0), device(1)])
            n.until("all back on the stream", lambda: n.stream_shows(ok))
            n.until("taints gone", lambda: n.taints() == {"gpu-0": None, "gpu-1": None})
            n.until("NVML up", lambda: nvml_up(n.samples()) == 1)
            assert healthy(n.samples()) == {"0": 1, "1": 1}
            phases.append(n.samples())
        finally:
            code = n.close()
        assert code == 0, n.plugin.output()

    first = phases[0]
    node = {"Hostname": only(first, "vgpu_nvml_up")[0].labels["Hostname"], "severity": "critical"}
    promtool_check(
        phases,
        [
            {},  # healthy
            {"VgpuDeviceUnhealthy": [labels_of(first, "1")]},  # XID
            {},  # recovered
            {"VgpuDeviceUnhealthy": [labels_of(first, "1")]},  # lost
            {"VgpuNvmlDown": [node]},  # NVML down: one alert for the node, none per GPU
            {},  # recovered
        ],
        tmp_path,
    )

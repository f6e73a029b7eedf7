"""Helpers of the observability tests: a real `vgpu exporter` process, real HTTP scrapes, and
tenants running under the shim on the simulated GPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sharing import region
from sharing.cli.run import write_region_limits
from sharing.limitsfile import render_limits_file

MiB = 1 << 20
_SERVING = re.compile(r"serving (http://\S+)/metrics")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def scrape(base_url: str, timeout: float = 10.0) -> list[Sample]:
    """GET /metrics and parse it with prometheus_client's own parser."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as r:
        assert r.status == 200
        text = r.read().decode()
    return [
        Sample(s.name, dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def only(samples: list[Sample], name: str, **labels: str) -> list[Sample]:
    return [
        s
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    got = only(samples, name, **labels)
    assert len(got) == 1, f"{name} {labels}: {len(got)} series: {got}"
    return got[0].value


class ExporterProcess:
    """`vgpu exporter ARGS` in its own process; url once it serves."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        cmd = [sys.executable, "-m", "sharing.cli", "exporter", "--listen", "127.0.0.1:0", *args]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
        )
        self.log: list[str] = []
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            m = _SERVING.search(line)
            if m:
                self.url = m.group(1)
                break
        else:
            self.proc.wait(10)
            raise AssertionError(f"exporter did not start: {''.join(self.log)}")

    def stop(self) -> str:
        """SIGTERM; returns the rest of its log."""
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=20)
        self.log.append(err)
        assert self.proc.returncode == 0, "".join(self.log)
        return "".join(self.log)


def start_tenant(
    env: dict[str, str], region: Path, memory: str, compute: int, *workload: str
) -> subprocess.Popen[str]:
    """A tenant exactly as a user starts one: `vgpu run` + an ordinary CUDA client."""
    cmd = [
        sys.executable, "-m", "sharing.cli", "run", "--sim", "--memory", memory,
        "--compute", str(compute), "--region", str(region), "--",
        sys.executable, "-m", "sharing.cli.demo_workload", *workload,
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def scrape_until(
    url: str, ok: Callable[[list[Sample]], bool], timeout: float = 15.0
) -> list[Sample]:
    """Scrape until ok(samples) (the exporter serves an exposition up to --cache seconds old)."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(url)
        if ok(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def add_claim(
    data_dir: Path,
    uid: str,
    name: str,
    uuid: str,
    memory: int,
    sm: int,
    ns: str = "team",
    device: tuple[str, str] | None = None,
    policy: str = "hard",
) -> Path:
    """What the plugin leaves for a prepared claim: checkpoint entry, CDI spec, limits file and
    accounting file (driver/claimfiles.py's layout); device: the (pool, device) the claim was
    allocated; policy: its compute policy. Returns the claim's shared/ directory (the one
    holding the accounting file)."""
    d = data_dir / "claims" / uid
    (d / "shared").mkdir(parents=True)
    text = render_limits_file(
        memory_limits=[memory],
        sm_limits=[sm],
        policy=policy,
        priority=1,
        shared_cache="/run/vgpu-sharing/accounting",
    )
    (d / "limits").write_text(text)
    region.create(d / "shared" / "accounting")
    spec = data_dir / "cdi" / f"{uid}.json"
    spec.parent.mkdir(exist_ok=True)
    env = [f"CUDA_VISIBLE_DEVICES={uuid}", f"CUDA_DEVICE_MEMORY_LIMIT_0={memory}",
           f"CUDA_DEVICE_SM_LIMIT_0={sm}"]  # fmt: skip
    spec.write_text(json.dumps({"devices": [{"name": uid, "containerEdits": {"env": env}}]}))
    ck = data_dir / "checkpoint.json"
    doc: dict[str, Any] = (
        json.loads(ck.read_text()) if ck.exists() else {"version": 1, "claims": {}}
    )
    doc["claims"][uid] = {"uid": uid, "namespace": ns, "name": name, "state": "PrepareCompleted",
                          "cdi_spec": str(spec), "claim_dir": str(d)}  # fmt: skip
    if device is not None:
        doc["claims"][uid]["devices"] = [
            {"request_names": ["gpu"], "pool_name": device[0], "device_name": device[1],
             "cdi_device_ids": [f"k8s.vgpu.sharing.dev/claim={uid}"], "share_id": None}
        ]  # fmt: skip
    ck.write_text(json.dumps(doc))
    return d / "shared"


def region_with_limits(path: Path, memory: int, sm: int | None = None) -> Path:
    """A `vgpu run --region` accounting file with the FILE.limits `vgpu run` writes beside it."""
    region.create(path)
    env = {"CUDA_DEVICE_MEMORY_LIMIT_0": str(memory)}
    if sm is not None:
        env["CUDA_DEVICE_SM_LIMIT_0"] = str(sm)
    write_region_limits(str(path), env)
    return path


def sim_gpu_uuid(env: dict[str, str], index: int = 0) -> str:
    """The simulated GPU's UUID, as `vgpu info --sim` reports it."""
    r = subprocess.run(
        [sys.executable, "-m", "sharing.cli", "info", "--sim", "--json"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    uuid: str = json.loads(r.stdout)["gpus"][index]["uuid"]
    return uuid

"""Resident memory of the whole `vgpu-kubelet-plugin` process, for the DaemonSet's requests and
limits (deploy/base/daemonset.yaml).

    .venv/bin/python benchmarks/bench_plugin_rss.py [--gpus 1,8,16] [--json]

The real console script runs on the simulated GPUs (libnvidia-ml.so.1 from shim/sim) against the
fake API server, in sharing mode with the shipped policy, until its slices are published; then its
VmRSS and peak VmHWM are read after a few seconds of steady state. Baseline, measured in the same
run: a bare Python interpreter that imports the same top-level modules (kubernetes, grpc,
pynvml), so the ratio says how much the plugin holds beyond its libraries.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fakes.apiserver import FakeApiServer  # noqa: E402
from tests.support.plugin_e2e import PluginProcess, device, devices_of, write_config  # noqa: E402

MiB = 2**20
SETTLE = 5.0  # seconds of steady state before reading


def gpu(i: int) -> dict[str, object]:
    return device(i) | {
        "uuid": f"GPU-5e1f0000-0000-0000-0000-{i:012x}",
        "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0",
        "minor": i,
    }


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} for pid {pid}")


def baseline_mib() -> float:
    code = (
        "import kubernetes.client, grpc, pynvml, yaml, pathlib;"
        "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines()"
        " if l.startswith('VmHWM:')][0].split()[1])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip()) / 1024


def plugin_mib(n_gpus: int) -> tuple[float, float]:
    root = Path(tempfile.mkdtemp(prefix="vgr", dir="/tmp"))
    try:
        text = (REPO / "deploy" / "base" / "policy.yaml").read_text()
        [cm] = [d for d in yaml.safe_load_all(text) if d]
        (root / "policy.yaml").write_text(cm["data"]["policy.yaml"])
        write_config(root / "simgpu.json", [gpu(i) for i in range(n_gpus)])
        with FakeApiServer() as server:
            server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}})
            p = PluginProcess(
                server, root, "--sharing-mode", "sharing", "--policy", str(root / "policy.yaml")
            )
            try:
                deadline = time.monotonic() + 60
                while len(devices_of(server)) < n_gpus:
                    if time.monotonic() > deadline or p.proc.poll() is not None:
                        raise RuntimeError(f"slices not published:\n{p.output()[-2000:]}")
                    time.sleep(0.2)
                time.sleep(SETTLE)
                pid = p.proc.pid
                return status_kib(pid, "VmRSS") / 1024, status_kib(pid, "VmHWM") / 1024
            finally:
                p.terminate()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1,8,16", help="comma-separated GPU counts")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = baseline_mib()
    rows = []
    for n in (int(x) for x in args.gpus.split(",")):
        rss, hwm = plugin_mib(n)
        rows.append({"gpus": n, "rss_mib": round(rss, 1), "hwm_mib": round(hwm, 1)})
    if args.json:
        print(json.dumps({"baseline_mib": round(base, 1), "plugin": rows}))
        return 0
    print(f"vgpu-kubelet-plugin resident memory (baseline: imports only, {base:.1f} MiB)")
    for r in rows:
        print(
            f"  {r['gpus']:3d} GPUs  RSS {r['rss_mib']:6.1f} MiB  peak {r['hwm_mib']:6.1f} MiB"
            f"  ({r['hwm_mib'] / base:.2f}x baseline)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

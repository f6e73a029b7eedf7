"""Prepare/unprepare latency of the DRA plugin, and its memory with many prepared claims.

    .venv/bin/python benchmarks/bench_prepare.py [--claims 200] [--json]

The plugin runs as its own process (tests/driver/plugin_process.py: the real Driver) and reads
ResourceClaims over loopback HTTP from the fake API server (tests/fakes/apiserver.py). A
kubelet stand-in prepares the claims one NodePrepareResources call each (as the kubelet does per
pod) over the real unix socket, then unprepares them one by one. Each call writes the CDI spec,
the claim directory and the checkpoint (twice for prepare) with fsync, so the numbers depend on
the disk. Resident memory is the plugin process's VmRSS before and with all claims prepared.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.driver.kubelet_standin import (  # noqa: E402
    DRIVER,
    KubeletStandin,
    allocated_claim,
    claim_id,
    result,
)
from tests.driver.plugin_process import PluginProcess, fake_gpus  # noqa: E402
from tests.fakes.apiserver import FakeApiServer  # noqa: E402


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claims", type=int, default=200)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    n = args.claims
    root = Path(tempfile.mkdtemp(prefix="vgb", dir="/tmp"))
    try:
        with FakeApiServer() as server:
            claims = [
                claim_id(
                    server.put(
                        allocated_claim(
                            f"claim-{i}",
                            results=[result("gpu", f"gpu-{i % 2}", memory="256Mi", cores="1")],
                        )
                    )
                )
                for i in range(n)
            ]
            plugin = PluginProcess(root, server.url, fake_gpus(2))
            plugin.start()
            assert plugin.proc is not None
            pid = plugin.proc.pid
            try:
                kubelet = KubeletStandin(root / "registry" / f"{DRIVER}-reg.sock")
                kubelet.register()
                kubelet.prepare([])  # warm the channel
                rss_idle = rss_bytes(pid)
                prep: list[float] = []
                for c in claims:
                    t = time.perf_counter()
                    out = kubelet.prepare([c])
                    prep.append(time.perf_counter() - t)
                    if out[c.uid].error:
                        raise RuntimeError(out[c.uid].error)
                rss_full = rss_bytes(pid)
                again: list[float] = []
                for c in claims[:50]:
                    t = time.perf_counter()
                    kubelet.prepare([c])
                    again.append(time.perf_counter() - t)
                unprep: list[float] = []
                for c in claims:
                    t = time.perf_counter()
                    errs = kubelet.unprepare([c])
                    unprep.append(time.perf_counter() - t)
                    if errs[c.uid]:
                        raise RuntimeError(errs[c.uid])
                kubelet.close()
            finally:
                plugin.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ms = 1000.0
    res = {
        "claims": n,
        "prepare_p50_ms": round(pct(prep, 50) * ms, 2),
        "prepare_p99_ms": round(pct(prep, 99) * ms, 2),
        "prepare_mean_ms": round(statistics.fmean(prep) * ms, 2),
        "repeat_prepare_p50_ms": round(pct(again, 50) * ms, 2),
        "unprepare_p50_ms": round(pct(unprep, 50) * ms, 2),
        "unprepare_p99_ms": round(pct(unprep, 99) * ms, 2),
        "rss_idle_mib": round(rss_idle / 2**20, 1),
        "rss_with_claims_mib": round(rss_full / 2**20, 1),
    }
    if args.json:
        print(json.dumps(res))
    else:
        print(f"DRA plugin, {n} claims, one claim per call, fake API server on loopback")
        print(f"  prepare      p50 {res['prepare_p50_ms']} ms   p99 {res['prepare_p99_ms']} ms"
              f"   (mean {res['prepare_mean_ms']} ms)")  # fmt: skip
        print(
            f"  re-prepare   p50 {res['repeat_prepare_p50_ms']} ms (answered from the checkpoint)"
        )
        print(f"  unprepare    p50 {res['unprepare_p50_ms']} ms   p99 {res['unprepare_p99_ms']} ms")
        print(f"  plugin RSS   {res['rss_idle_mib']} MiB idle, "
              f"{res['rss_with_claims_mib']} MiB with {n} claims prepared")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost the second bound (bursting, docs/policy.md) adds to an allocation, on the simulated GPU, in
one run against the same program without the shim and with a plain quota:

    .venv/bin/python benchmarks/bench_burst.py [--n 100000] [--callgrind-n 10000] [--json]

Every variant runs benchmarks/c/shim_bench.c `big`: cuMemAlloc_v2(2 MiB) + cuMemFree_v2 pairs (a
page of their own: every pair is charged and given back) while 1 GiB is held:
  - "quota": a 64 GiB quota (the slice stays far below it);
  - "bursting, below the request": request 64 GiB, limit 128 GiB: every charge reads the grant;
  - "bursting, borrowing": request 1 GiB, limit 64 GiB, grant 63 GiB: the context and the held
    1 GiB are above the request, so every pair borrows (the grant is read before the charge and
    again after it, behind a full fence).
Wall ns per pair (median of 5 alternating runs) and callgrind instructions of the measured loop.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_shim_memory import Bench  # noqa: E402
from sharing import burstpool  # noqa: E402

HELD_MIB = 1024


def variants(b: Bench, work: Path) -> dict[str, dict[str, str]]:
    pool = work / "pool"
    burstpool.create(pool)
    with burstpool.Pool(pool, writable=True) as p:
        p.write_grant(0, key=1, device=0, state=burstpool.GRANT_OPEN, request=1 << 30,
                      limit=64 << 30, grant=63 << 30)  # fmt: skip
    shim = b.envs["shim, 64 GiB quota"]
    burst = dict(shim, VGPU_BURST_POOL=str(pool), VGPU_BURST_GRANT_0="0", VGPU_BURST_KEY_0="1")
    return {
        "baseline": b.envs["baseline"],
        "quota": dict(shim, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(work / "quota.region")),
        "bursting, below the request": dict(
            burst,
            VGPU_MEMORY_BURST_LIMIT_0="128Gi",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(work / "below.region"),
        ),
        "bursting, borrowing": dict(
            burst,
            CUDA_DEVICE_MEMORY_LIMIT="1Gi",
            VGPU_MEMORY_BURST_LIMIT_0="64Gi",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(work / "borrow.region"),
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="pairs per timed run")
    ap.add_argument(
        "--callgrind-n", type=int, default=10_000, help="pairs under callgrind (0: skip)"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-burst-"))
    report: dict[str, dict[str, float]] = {}
    try:
        b = Bench(work)
        envs = variants(b, work)
        held = str(HELD_MIB)
        runs: dict[str, list[float]] = {k: [] for k in envs}
        for _ in range(5):  # alternate, so drift hits every variant alike
            for k, env in envs.items():
                runs[k].append(b.ns("big", env, args.n, held))
        for k in envs:
            report[k] = {"ns": statistics.median(runs[k])}
        if args.callgrind_n and shutil.which("valgrind"):
            for k, env in envs.items():
                report[k]["instructions"] = b.instructions("big", env, args.callgrind_n, held)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    base = report["baseline"]
    print("cuMemAlloc_v2(2 MiB) + cuMemFree_v2, 1 GiB held:")
    for k, e in report.items():
        line = f"  {k:28s} {e['ns']:9.1f} ns  x{e['ns'] / base['ns']:.2f}"
        if "instructions" in e:
            line += f"   {e['instructions']:9.0f} instr  x{e['instructions'] / base['instructions']:.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

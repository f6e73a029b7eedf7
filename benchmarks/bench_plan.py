"""`vgpu plan` at cluster scale: 1,000 nodes x 8 GPUs, 20,000 claims.

    .venv/bin/python benchmarks/bench_plan.py [--nodes 1000] [--gpus 8] [--claims 20000]
        [--format yaml|json] [--json]

The slices are what the plugin publishes (driver.slicebuild.pool_slices, sharing mode) for
nodes of A100 40GB (first half) and H100 80GB GPUs (second half), written as one YAML (or
JSON) file per node and read back by the planner's loader. The workloads mix CEL selectors on
attributes, capacity and versions, a two-request claim with matchAttribute, and whole-GPU
claims that run out (so the "why not" path is measured too). Reported: load time, plan time,
time per claim, CEL evaluations actually run, and the ratio against a baseline planned in the
same run: the same claims with every selector and constraint removed (first fit on capacity
only, no CEL).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from driver.discovery import DiscoveredGpu, Inventory  # noqa: E402
from driver.slicebuild import pool_slices  # noqa: E402
from sharing.claimlayout import DEFAULT_DRIVER_NAME as DRIVER  # noqa: E402
from sharing.gpus import GpuInfo  # noqa: E402
from sharing.plan.cel_eval import SelectorEvaluator  # noqa: E402
from sharing.plan.loader import _Ctx, load_slices, parse_claim_spec  # noqa: E402
from sharing.plan.model import DeviceClass, Workload  # noqa: E402
from sharing.plan.planner import Plan, plan, prepare  # noqa: E402
from sharing.plan.report import to_json, to_text  # noqa: E402

CLASS = DeviceClass(DRIVER, (f'device.driver == "{DRIVER}"',))
GiB = 1024**3


def node_gpus(n: int, gpus: int, big: bool) -> Inventory:
    out = []
    for i in range(gpus):
        info = GpuInfo(
            index=i,
            uuid=f"GPU-{n:05d}{i:03d}-0000-0000-0000-000000000000",
            name="NVIDIA H100 80GB HBM3" if big else "NVIDIA A100-SXM4-40GB",
            memory_total=(80 if big else 40) * GiB,
            memory_used=0,
            pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
            minor=i,
            numa_node=i * 2 // gpus,
            compute_capability="9.0" if big else "8.0",
            driver_version="550.54.15",
            cuda_driver_version="12.4",
        )
        out.append(DiscoveredGpu(info=info, pcie_root=f"pci0000:{0x18 + i:02x}"))
    return Inventory(tuple(out))


def write_slices(root: Path, nodes: int, gpus: int, fmt: str = "yaml") -> None:
    for n in range(nodes):
        name = f"node-{n:04d}"
        items = pool_slices(node_gpus(n, gpus, n >= nodes // 2), "sharing", 4, DRIVER, name, 1)
        doc = {"apiVersion": "v1", "kind": "List", "items": items}
        text = json.dumps(doc, indent=4) if fmt == "json" else yaml.safe_dump(doc, sort_keys=False)
        (root / f"{name}.{fmt}").write_text(text)


def _req(name: str, caps: dict[str, str], selectors: list[str]) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": DRIVER, "capacity": {"requests": caps}}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    return {"name": name, "exactly": exactly}


def workload_specs(claims: int) -> list[tuple[str, float, dict[str, Any]]]:
    """(name, share of the claims, ResourceClaimSpec)."""
    d = f'"{DRIVER}"'
    return [
        (
            "infer-small",
            0.40,
            {
                "devices": {
                    "requests": [
                        _req(
                            "gpu",
                            {"memory": "3500Mi", "cores": "10"},
                            [f'device.attributes[{d}].productName.startsWith("NVIDIA")'],
                        )
                    ]
                }
            },
        ),
        (
            "infer-big",
            0.20,
            {
                "devices": {
                    "requests": [
                        _req(
                            "gpu",
                            {"memory": "10Gi", "cores": "20"},
                            [f'device.capacity[{d}].memory.compareTo(quantity("64Gi")) >= 0'],
                        )
                    ]
                }
            },
        ),
        (
            "ampere-plus",
            0.20,
            {
                "devices": {
                    "requests": [
                        _req(
                            "gpu",
                            {"memory": "2Gi", "cores": "5"},
                            [
                                f'device.attributes[{d}].cudaComputeCapability.isGreaterThan(semver("7.5.0"))'
                            ],
                        )
                    ]
                }
            },
        ),
        (
            "train-pair",
            0.10,
            {
                "devices": {
                    "requests": [
                        _req("a", {"memory": "16Gi", "cores": "25"}, []),
                        _req("b", {"memory": "16Gi", "cores": "25"}, []),
                    ],
                    "constraints": [{"matchAttribute": f"{DRIVER}/numaNode"}],
                }
            },
        ),
        ("whole-gpu", 0.09, {"devices": {"requests": [_req("gpu", {}, [])]}}),
        # Above every GPU's validRange.max: never fits, exercises the "why not" path.
        ("too-big", 0.01, {"devices": {"requests": [_req("gpu", {"memory": "96Gi"}, [])]}}),
    ]


def workloads(claims: int, baseline: bool) -> list[Workload]:
    ctx = _Ctx(Path("bench"))
    out = []
    specs = workload_specs(claims)
    left = claims
    for k, (name, share, spec) in enumerate(specs):
        n = left if k == len(specs) - 1 else int(claims * share)
        left -= n
        if baseline:
            spec = json.loads(json.dumps(spec))
            spec["devices"].pop("constraints", None)
            for r in spec["devices"]["requests"]:
                r["exactly"].pop("selectors", None)
        out.append(Workload(name, n, parse_claim_spec(ctx, "spec", spec)))
    return out


def run(path: Path, claims: int, baseline: bool) -> tuple[Plan, float, float, int]:
    """(plan, load seconds, plan seconds, CEL evaluations)."""
    t0 = time.perf_counter()
    inv, _ = load_slices(path)
    gc.freeze()  # as `vgpu plan` does once its inputs are read
    t1 = time.perf_counter()
    ev = SelectorEvaluator()
    ws = workloads(claims, baseline)
    # The baseline runs no CEL at all: its class has no selector either.
    classes = {DRIVER: DeviceClass(DRIVER, ()) if baseline else CLASS}
    result = plan(inv, ws, prepare(ws, classes, ev, Path("bench")), ev)
    t2 = time.perf_counter()
    return result, t1 - t0, t2 - t1, ev.evaluations


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--claims", type=int, default=20000)
    ap.add_argument(
        "--format",
        choices=("yaml", "json"),
        default="yaml",
        help="how the slices are written (kubectl -o yaml / -o json)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.nodes < 2 or args.gpus < 2 or args.claims < 10:
        ap.error("--nodes and --gpus must be >= 2, --claims >= 10")
    with tempfile.TemporaryDirectory(prefix="vgpu-plan-bench-") as tmp:
        root = Path(tmp)
        print(
            f"writing {args.nodes} nodes x {args.gpus} GPUs of ResourceSlices...", file=sys.stderr
        )
        write_slices(root, args.nodes, args.gpus, args.format)
        SelectorEvaluator()  # builds the CEL grammar once (cached), outside both timings
        print("planning the baseline (no selectors, no constraints)...", file=sys.stderr)
        base, _, base_plan, _ = run(root, args.claims, baseline=True)
        print(f"planning {args.claims} claims...", file=sys.stderr)
        result, load, planned, evaluations = run(root, args.claims, baseline=False)
    t = time.perf_counter()
    text = to_text(result)
    doc = json.dumps(to_json(result))
    report_s = time.perf_counter() - t
    placed = len({(p.workload, p.replica) for p in result.placed})
    report = {
        "nodes": args.nodes,
        "format": args.format,
        "gpus_per_node": args.gpus,
        "claims": args.claims,
        "placed": placed,
        "unplaced": len(result.unplaced),
        "load_s": round(load, 3),
        "plan_s": round(planned, 3),
        "report_s": round(report_s, 3),
        "report_bytes": {"text": len(text), "json": len(doc)},
        "total_s": round(load + planned + report_s, 3),
        "us_per_claim": round(planned / args.claims * 1e6, 1),
        "cel_evaluations": evaluations,
        "baseline_plan_s": round(base_plan, 3),
        "baseline_us_per_claim": round(base_plan / args.claims * 1e6, 1),
        "ratio_vs_baseline": round(planned / base_plan, 2) if base_plan else None,
        "baseline_placed": len({(p.workload, p.replica) for p in base.placed}),
        "within_10s": load + planned + report_s < 10.0,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.nodes} nodes x {args.gpus} GPUs, {args.claims} claims, slices in {args.format}")
    print(f"  load slices   {load:8.3f} s")
    print(
        f"  plan          {planned:8.3f} s   {report['us_per_claim']} us/claim, "
        f"{placed} placed, {len(result.unplaced)} not placed, {evaluations} CEL evaluations"
    )
    print(
        f"  baseline plan {base_plan:8.3f} s   {report['baseline_us_per_claim']} us/claim "
        "(same claims, no selectors/constraints)"
    )
    print(f"  report        {report_s:8.3f} s   text and JSON of the plan")
    print(f"  ratio plan/baseline: {report['ratio_vs_baseline']}")
    print(
        f"  load + plan + report: {report['total_s']} s, under 10 s: "
        f"{'yes' if report['within_10s'] else 'NO'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

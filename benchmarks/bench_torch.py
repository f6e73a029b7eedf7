"""libvgpu.so under PyTorch on the simulated GPU: the shim's overhead, and the compute cap's error.

    .venv/bin/python benchmarks/bench_torch.py [--rounds 9] [--iterations 20000]
        [--sms 16,48,108,132,188] [--caps 10,30,50,70,90] [--warmup 1] [--seconds 3]
        [--only overhead,caps] [--json] [--update-md]

Needs torch in .venv/frameworks (scripts/setup without VGPU_SETUP_FRAMEWORKS=0).

Overhead: benchmarks/torch_small_kernels.py (a loop of small kernels with allocations through the
caching allocator) run directly on the simulator, and under `vgpu run --sim` with a memory quota,
then with a quota and a 90% cap (which the loop's device share stays under: the gate runs, it
does not hold launches back). The three alternate for --rounds rounds; the figures are the medians
(and the minimum: the run least disturbed by other work) of each process's host CPU time and the
median wall time per iteration, as a ratio to the run without the shim (target with a cap set:
<= 1.03). On a shared machine these timings move by tens of percent from run to run: rerun on an
idle machine before reading a few percent into them.

Cap error: tests/clients/programs/torch_client.py elementwise (in-place add, mul, relu back to
back; the tensor sized so a kernel takes about 1.2 ms of simulated time whatever the SM count;
a queue of 1 s of work, SIMGPU_QUEUE_AHEAD_US, as a GPU's 1024-launch pushbuffer holds of such
kernels, so a loaded host does not idle the device) on one simulated device of each --sms SM count (SIMGPU_CONFIG sm_count), uncapped and under
`vgpu run --sim --compute C`, with the simulator's default duration spread and tail. The share is
the driver's: the device time the simulator served the process (simgpuProcessBusyNs) over a
window bracketed by torch.cuda.synchronize(). Target: each within +-2 points of its cap.

`--update-md` rewrites the torch section of BENCHMARKS.md (between its markers).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sharing.paths import sim_lib_dir  # noqa: E402

FRAMEWORKS_PYTHON = REPO / ".venv" / "frameworks" / "bin" / "python"
SMALL = REPO / "benchmarks" / "torch_small_kernels.py"
CLIENT = REPO / "tests" / "clients" / "programs" / "torch_client.py"
MD_BEGIN = "<!-- bench_torch:begin -->"
MD_END = "<!-- bench_torch:end -->"
QUOTA = "4Gi"
OVERHEAD_CAP = "90"
NUMEL_132 = 16 << 20  # floats: about 1.2 ms per elementwise kernel on 132 SMs
CONFIGS = {
    "no shim": None,
    "shim, quota": ["--memory", QUOTA],
    "shim, quota + cap 90%": ["--memory", QUOTA, "--compute", OVERHEAD_CAP],
}


def base_env(tmp: Path, sm_count: int | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA_DEVICE_", "VGPU_", "SIMGPU_")) and k != "LD_PRELOAD"
    }
    state = tmp / "simgpu-state"
    state.mkdir(exist_ok=True)
    env.update(
        LD_LIBRARY_PATH=str(sim_lib_dir()),
        SIMGPU_STATE=str(state),
        VGPU_NODE_STATE_DIR=str(tmp / "node"),
        PYTHONWARNINGS="ignore",
    )
    if sm_count is not None:
        cfg = tmp / f"sim-{sm_count}.json"
        cfg.write_text(json.dumps({"devices": [{"sm_count": sm_count}]}))
        env["SIMGPU_CONFIG"] = str(cfg)
    return env


def run(env: dict[str, str], vgpu: list[str] | None, *cmd: str) -> str:
    full = [str(FRAMEWORKS_PYTHON), *cmd]
    if vgpu is not None:
        full = [sys.executable, "-m", "sharing.cli", "run", "--sim", *vgpu, "--", *full]
    r = subprocess.run(full, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(full)} exited {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout


def kv(out: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", out)}


def overhead(rounds: int, iterations: int) -> dict[str, dict[str, float]]:
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as d:
        env = base_env(Path(d))
        for _ in range(rounds):
            for name, vgpu in CONFIGS.items():
                samples[name].append(kv(run(env, vgpu, str(SMALL), str(iterations))))
    result: dict[str, dict[str, float]] = {}
    for name, xs in samples.items():
        cpu = [x["cpu_ns_per_iter"] / 1e3 for x in xs]
        wall = [x["wall_ns_per_iter"] / 1e3 for x in xs]
        result[name] = {
            "cpu_us": statistics.median(cpu),
            "cpu_min_us": min(cpu),
            "wall_us": statistics.median(wall),
        }
    base = result["no shim"]
    for r in result.values():
        r["cpu_ratio"] = r["cpu_us"] / base["cpu_us"]
        r["cpu_min_ratio"] = r["cpu_min_us"] / base["cpu_min_us"]
        r["wall_ratio"] = r["wall_us"] / base["wall_us"]
    return result


def caps(sms: list[int], cap_list: list[int], warmup: str, seconds: str) -> list[dict[str, float]]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for sm in sms:
            env = dict(base_env(Path(d), sm), SIMGPU_QUEUE_AHEAD_US="1000000")
            numel = NUMEL_132 * sm // 132
            for cap in [0, *cap_list]:
                vgpu = ["--compute", str(cap)] if cap else []
                out = run(env, vgpu, str(CLIENT), "elementwise", warmup, seconds, str(numel))
                x = kv(out)
                rows.append(
                    {
                        "sms": sm,
                        "cap": cap,
                        "share": x["share"],
                        "error": x["share"] - cap if cap else 0.0,
                        "cpu_wait": x["cpu_wait"],
                        "kernel_ms": 1e3 * x["window_s"] * x["share"] / 100 / x["launches"],
                    }
                )
                print(f"sms={sm} cap={cap or 'none'} {out.strip()}", file=sys.stderr, flush=True)
    return rows


def markdown(
    ov: dict[str, dict[str, float]] | None, rows: list[dict[str, float]] | None, args: object
) -> str:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [MD_BEGIN, f"Load average at the end of the run (1/5/15 min): {load}.", ""]
    if ov is not None:
        lines += [
            "| configuration | host CPU per iteration, median | ratio | minimum | ratio "
            "| wall per iteration, median | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in ov.items():
            lines.append(
                f"| {name} | {r['cpu_us']:.1f} us | x{r['cpu_ratio']:.3f} "
                f"| {r['cpu_min_us']:.1f} us | x{r['cpu_min_ratio']:.3f} "
                f"| {r['wall_us']:.1f} us | x{r['wall_ratio']:.3f} |"
            )
        lines.append("")
    if rows is not None:
        sms = sorted({int(r["sms"]) for r in rows})
        cap_list = sorted({int(r["cap"]) for r in rows if r["cap"]})
        lines += [
            "| SMs | kernel | uncapped | " + " | ".join(f"cap {c}" for c in cap_list) + " |",
            "|---|---|---|" + "---|" * len(cap_list),
        ]
        for sm in sms:
            mine = [r for r in rows if r["sms"] == sm]
            un = next(r for r in mine if not r["cap"])
            cells = [
                f"{r['share']:.2f} ({r['error']:+.2f})"
                for c in cap_list
                for r in mine
                if r["cap"] == c
            ]
            lines.append(
                f"| {sm} | {un['kernel_ms']:.2f} ms | {un['share']:.2f} | "
                + " | ".join(cells)
                + " |"
            )
        errs = [abs(r["error"]) for r in rows if r["cap"]]
        lines += ["", f"Cap error: max {max(errs):.2f} points, MAE {statistics.mean(errs):.2f}."]
    lines.append(MD_END)
    return "\n".join(lines)


def update_md(section: str) -> None:
    md = REPO / "BENCHMARKS.md"
    text = md.read_text()
    if MD_BEGIN not in text:
        raise SystemExit(f"BENCHMARKS.md has no {MD_BEGIN} marker: add the torch section first")
    head, rest = text.split(MD_BEGIN, 1)
    _, tail = rest.split(MD_END, 1)
    md.write_text(head + section + tail)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--iterations", type=int, default=20000)
    p.add_argument("--sms", default="16,48,108,132,188")
    p.add_argument("--caps", default="10,30,50,70,90")
    p.add_argument("--warmup", default="1")
    p.add_argument("--seconds", default="3")
    p.add_argument("--only", default="overhead,caps")
    p.add_argument("--json", action="store_true")
    p.add_argument("--update-md", action="store_true")
    args = p.parse_args()
    if not FRAMEWORKS_PYTHON.exists():
        raise SystemExit(f"{FRAMEWORKS_PYTHON} does not exist: run scripts/setup to install torch")
    only = set(args.only.split(","))
    unknown = only - {"overhead", "caps"}
    if unknown:
        raise SystemExit(f"--only {','.join(sorted(unknown))}: allowed: overhead, caps")
    ov = overhead(args.rounds, args.iterations) if "overhead" in only else None
    rows = None
    if "caps" in only:
        sms = [int(s) for s in args.sms.split(",")]
        cap_list = [int(c) for c in args.caps.split(",")]
        rows = caps(sms, cap_list, args.warmup, args.seconds)
    if args.json:
        print(json.dumps({"overhead": ov, "caps": rows}, indent=1))
    section = markdown(ov, rows, args)
    print(section)
    if args.update_md:
        update_md(section)


if __name__ == "__main__":
    main()

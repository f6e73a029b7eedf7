"""libvgpu.so under PyTorch on the simulated GPU: the shim's overhead, and the compute cap's error.

    .venv/bin/python benchmarks/bench_torch.py [--rounds 9] [--iterations 20000]
        [--cg-iterations 1000] [--sms 16,48,108,132,188] [--caps 10,30,50,70,90]
        [--gemm-n SM:N,...] [--warmup 1] [--seconds 3]
        [--only overhead,instructions,elementwise,matmul] [--json] [--update-md]

Needs torch in .venv/frameworks (scripts/setup without VGPU_SETUP_FRAMEWORKS=0); the
instruction count needs valgrind (callgrind) and gcc. `--only caps` is elementwise,matmul.

Overhead: benchmarks/torch_small_kernels.py (a loop of small kernels with allocations through the
caching allocator) run directly on the simulator, and under `vgpu run --sim` with a memory quota,
then with a quota and a 90% cap (which the loop's device share stays under: the gate runs, it
does not hold launches back).
* overhead: the three alternate for --rounds rounds; the figures are the medians (and the
  minimum: the run least disturbed by other work) of each process's host CPU time and the median
  wall time per iteration, as a ratio to the run without the shim in the same rounds. On a shared
  machine these timings move by tens of percent from run to run.
* instructions: the same three under `valgrind --tool=callgrind --instr-atstart=no`, with
  --cg-iterations iterations of warm-up and as many measured: the program switches callgrind's
  instrumentation on for the measured iterations only (a client request from
  benchmarks/c/callgrind_toggle.c), so torch's start-up runs uninstrumented. Instructions per
  iteration of all threads, of the main thread (the one that calls CUDA, where the shim's hooks
  run) and of libvgpu.so's own code, as a ratio to the run without the shim (target with a cap
  set: <= 1.03). The simulator's kernels cost the host nothing, where a GPU's driver and
  hardware do more per launch than the simulator: the ratio is an upper bound of the shim's
  relative host cost on real hardware.

Cap error: tests/clients/programs/torch_client.py on one simulated device of each --sms SM count
(SIMGPU_CONFIG sm_count), uncapped and under `vgpu run --sim --compute C`, with the simulator's
default duration spread and tail, and a queue of 1 s of work (SIMGPU_QUEUE_AHEAD_US, as a GPU's
1024-launch pushbuffer holds of such kernels, so a loaded host does not idle the device). The
share is the driver's: the device time the simulator served the process (simgpuProcessBusyNs)
over a window bracketed by torch.cuda.synchronize(). Target: each within +-2 points of its cap.
* elementwise: in-place add, mul, relu back to back; the tensor sized so a kernel takes about
  1.2 ms of simulated time whatever the SM count.
* matmul: one N x N float GEMM (cuBLAS) per step. A kernel lasts 10 us per wave of its grid, and
  cuBLAS picks its kernel (tile size, hence grid) from the shape and the SM count, so N per SM
  count is a measured choice (GEMM_N, or --gemm-n) giving 140-810 us per GEMM; the table shows
  the kernel time each row measured.

`--update-md` rewrites, in BENCHMARKS.md, the block of each part this run measured (between its
markers), leaving the others as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import callgrind, frameworks  # noqa: E402

FRAMEWORKS_PYTHON = frameworks.FRAMEWORKS_PYTHON
SMALL = REPO / "benchmarks" / "torch_small_kernels.py"
CLIENT = REPO / "tests" / "clients" / "programs" / "torch_client.py"
PARTS = ("overhead", "instructions", "elementwise", "matmul")
QUOTA = "4Gi"
OVERHEAD_CAP = "90"
NUMEL_132 = 16 << 20  # floats: about 1.2 ms per elementwise kernel on 132 SMs
# N of the N x N float GEMM per SM count, measured (uncapped, default spread): 16 SMs 2304 (cuBLAS
# picks a 64x64-tile kernel: about 810 us), 48: 2304 (about 270 us), 108: 5632 (180 us), 132: 8192
# (160 us, tests/clients/test_torch_compute.py), 188: 9216 (140 us). Chosen while other sizes
# failed to load their sm_80 CUTLASS kernels on the simulator (since fixed: they run now).
GEMM_N = {16: 2304, 48: 2304, 108: 5632, 132: 8192, 188: 9216}
CONFIGS = {
    "no shim": None,
    "shim, quota": ["--memory", QUOTA],
    "shim, quota + cap 90%": ["--memory", QUOTA, "--compute", OVERHEAD_CAP],
}


def base_env(tmp: Path, sm_count: int | None = None) -> dict[str, str]:
    env = frameworks.sim_env(tmp)
    if sm_count is not None:
        cfg = tmp / f"sim-{sm_count}.json"
        cfg.write_text(json.dumps({"devices": [{"sm_count": sm_count}]}))
        env["SIMGPU_CONFIG"] = str(cfg)
    return env


def run(env: dict[str, str], vgpu: list[str] | None, *cmd: str, wrap: tuple[str, ...] = ()) -> str:
    return frameworks.run_python(env, vgpu, *cmd, wrap=wrap)


def kv(out: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", out)}


def ratios(result: dict[str, dict[str, float]], keys: list[str]) -> None:
    base = result["no shim"]
    for r in result.values():
        for k in keys:
            r[k + "_ratio"] = r[k] / base[k] if base[k] else float("nan")


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
    ratios(result, ["cpu_us", "cpu_min_us", "wall_us"])
    return result


def instructions(iterations: int) -> dict[str, dict[str, float]]:
    callgrind.need_tools()
    result: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        toggle = callgrind.build_toggle(tmp)
        env = base_env(tmp)
        for i, (name, vgpu) in enumerate(CONFIGS.items()):
            cg = tmp / f"cg.{i}"
            t0 = time.monotonic()
            wrap = tuple(callgrind.wrapper(cg))
            x = kv(run(env, vgpu, str(SMALL), str(iterations), str(toggle), wrap=wrap))
            result[name] = callgrind.summary(cg, iterations)
            result[name]["cpu_us"] = x["cpu_ns_per_iter"] / 1e3
            result[name]["run_s"] = time.monotonic() - t0
            print(f"callgrind {name}: {result[name]}", file=sys.stderr, flush=True)
    ratios(result, ["all", "main"])
    return result


def caps(
    workload: str, sms: list[int], cap_list: list[int], gemm_n: dict[int, int], w: str, s: str
) -> list[dict[str, float]]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for sm in sms:
            env = dict(base_env(Path(d), sm), SIMGPU_QUEUE_AHEAD_US="1000000")
            if workload == "elementwise":
                mode, size = "elementwise", NUMEL_132 * sm // 132
            else:
                mode, size = "matmul-heavy", gemm_n[sm]
            for cap in [0, *cap_list]:
                vgpu = ["--compute", str(cap)] if cap else []
                out = run(env, vgpu, str(CLIENT), mode, w, s, str(size))
                x = kv(out)
                rows.append(
                    {
                        "sms": sm,
                        "size": size,
                        "cap": cap,
                        "share": x["share"],
                        "error": x["share"] - cap if cap else 0.0,
                        "cpu_wait": x["cpu_wait"],
                        "kernel_ms": 1e3 * x["window_s"] * x["share"] / 100 / x["launches"],
                    }
                )
                print(
                    f"{workload} sms={sm} cap={cap or 'none'} {out.strip()}",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def header(command: str) -> str:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"`{command}`, {when}, load average {load} (1/5/15 min) at the end:"


def table_head(command: str, columns: str) -> list[str]:
    """The run's header line, then a table's head; `columns` are separated by " | "."""
    n = len(columns.split(" | "))
    return [header(command), "", f"| {columns} |", "|" + "---|" * n]


def md_configs(
    result: dict[str, dict[str, float]], command: str, columns: str, cells: str
) -> list[str]:
    """One row per configuration; `cells` is a format string over the configuration's figures."""
    rows = (f"| {name} | {cells.format(**r)} |" for name, r in result.items())
    return [*table_head(command, columns), *rows]


OVERHEAD_TABLE = (
    "configuration | host CPU per iteration, median | ratio | minimum | ratio "
    "| wall per iteration, median | ratio",
    "{cpu_us:.1f} us | x{cpu_us_ratio:.3f} | {cpu_min_us:.1f} us | x{cpu_min_us_ratio:.3f} "
    "| {wall_us:.1f} us | x{wall_us_ratio:.3f}",
)
INSTRUCTIONS_TABLE = (
    "configuration | instructions per iteration, all threads | ratio | main thread | ratio "
    "| of which libvgpu.so | of which the simulator's libcuda | threads",
    "{all:,.0f} | x{all_ratio:.3f} | {main:,.0f} | x{main_ratio:.3f} | {shim:,.0f} | {sim:,.0f} "
    "| {threads:.0f}",
)


def md_caps(rows: list[dict[str, float]], command: str, size_label: str) -> list[str]:
    sms = sorted({int(r["sms"]) for r in rows})
    cap_list = sorted({int(r["cap"]) for r in rows if r["cap"]})
    caps_head = " | ".join(f"cap {c}" for c in cap_list)
    lines = table_head(command, f"SMs | {size_label} | kernel | uncapped | {caps_head}")
    for sm in sms:
        mine = [r for r in rows if r["sms"] == sm]
        un = next(r for r in mine if not r["cap"])
        cells = [
            f"{r['share']:.2f} ({r['error']:+.2f})" for c in cap_list for r in mine if r["cap"] == c
        ]
        lines.append(
            f"| {sm} | {un['size']:.0f} | {un['kernel_ms']:.2f} ms | {un['share']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    errs = [abs(r["error"]) for r in rows if r["cap"]]
    if errs:
        lines += ["", f"Cap error: max {max(errs):.2f} points, MAE {statistics.mean(errs):.2f}."]
    return lines


def markers(part: str) -> tuple[str, str]:
    return f"<!-- bench_torch:{part}:begin -->", f"<!-- bench_torch:{part}:end -->"


def update_md(blocks: dict[str, list[str]], md: Path = REPO / "BENCHMARKS.md") -> None:
    text = md.read_text()
    for part, lines in blocks.items():
        begin, end = markers(part)
        if begin not in text or end not in text:
            raise SystemExit(f"{md.name} has no {begin} ... {end}: add the torch section first")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + "\n".join([begin, *lines, end]) + tail
    md.write_text(text)


def parse_gemm_n(spec: str) -> dict[int, int]:
    table = dict(GEMM_N)
    for item in filter(None, spec.split(",")):
        sm, _, n = item.partition(":")
        if not (sm.isdigit() and n.isdigit()):
            raise SystemExit(f"--gemm-n {item!r}: expected SM:N, e.g. 188:9216")
        table[int(sm)] = int(n)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--iterations", type=int, default=20000)
    p.add_argument("--cg-iterations", type=int, default=1000, help="under callgrind")
    p.add_argument("--sms", default="16,48,108,132,188")
    p.add_argument("--caps", default="10,30,50,70,90")
    p.add_argument("--gemm-n", default="", help="SM:N,... the GEMM size of an SM count")
    p.add_argument("--warmup", default="1")
    p.add_argument("--seconds", default="3")
    p.add_argument("--only", default=",".join(PARTS))
    p.add_argument("--json", action="store_true")
    p.add_argument("--update-md", action="store_true")
    args = p.parse_args()
    if not FRAMEWORKS_PYTHON.exists():
        raise SystemExit(f"{FRAMEWORKS_PYTHON} does not exist: run scripts/setup to install torch")
    only = set(args.only.replace("caps", "elementwise,matmul").split(","))
    unknown = only - set(PARTS)
    if unknown:
        raise SystemExit(f"--only {','.join(sorted(unknown))}: allowed: {', '.join(PARTS)}, caps")
    sms = [int(s) for s in args.sms.split(",")]
    cap_list = [int(c) for c in args.caps.split(",")]
    gemm_n = parse_gemm_n(args.gemm_n)
    if "matmul" in only and set(sms) - set(gemm_n):
        missing = ",".join(str(s) for s in sorted(set(sms) - set(gemm_n)))
        raise SystemExit(
            f"no GEMM size for {missing} SMs: give it with --gemm-n SM:N "
            f"(known: {', '.join(f'{k}:{v}' for k, v in sorted(gemm_n.items()))})"
        )
    command = "benchmarks/bench_torch.py " + " ".join(sys.argv[1:])
    command = command.replace(" --update-md", "").replace(" --json", "")
    results: dict[str, object] = {}
    blocks: dict[str, list[str]] = {}
    if "overhead" in only:
        ov = overhead(args.rounds, args.iterations)
        results["overhead"] = ov
        blocks["overhead"] = md_configs(ov, command, *OVERHEAD_TABLE)
    if "instructions" in only:
        ins = instructions(args.cg_iterations)
        results["instructions"] = ins
        blocks["instructions"] = md_configs(ins, command, *INSTRUCTIONS_TABLE)
    for part, label in (("elementwise", "floats"), ("matmul", "N")):
        if part in only:
            rows = caps(part, sms, cap_list, gemm_n, args.warmup, args.seconds)
            results[part] = rows
            blocks[part] = md_caps(rows, command, label)
    if args.json:
        print(json.dumps(results, indent=1))
    for part, lines in blocks.items():
        print("\n".join([f"{part}:", *lines, ""]))
    if args.update_md:
        update_md(blocks)


if __name__ == "__main__":
    main()

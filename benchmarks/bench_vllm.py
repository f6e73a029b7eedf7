"""vLLM on the simulated GPU: time to first token, and the instructions of its decode loop, in a
slice against without the shim.

    .venv/bin/python benchmarks/bench_vllm.py [--only ttft,instructions] [--rounds 2]
        [--requests 30] [--cg-steps 16] [--json]

Needs vLLM in .venv/frameworks (scripts/setup). tests/clients/programs/vllm_client.py's `ttft`
mode starts vLLM's offline engine in its own process (eager, the made-up 2-layer Llama of
tests/support/vllm_model.py, dummy weights, prompts as token ids) and, after two warm-up requests,
times --requests requests of one token from a 4-token prompt, one at a time: the median and the
minimum wall time of LLM.generate per request. Three configurations alternate for --rounds
rounds: directly on the simulator, under `vgpu run --sim --memory 8Gi`, and with a 90% compute
cap added (which a request stays under: the gate runs, it does not hold launches back). The
figures are the medians over rounds, and their ratio to the run without the shim. vLLM's
scheduler and sampler in Python dominate a request on the simulator (its kernels cost the host
nothing), so the ratio is a bound of the shim's relative cost on the request path, and on a
shared machine the timings move by several percent from run to run.

instructions: the same three configurations under callgrind (benchmarks/callgrind.py; needs
valgrind and gcc): vllm_client.py's `decode` mode runs two warm-up batches, then callgrind counts
one batch of 8 sequences of --cg-steps tokens (a prefill and the decode steps, eager: every
kernel is a cuLaunchKernel through the shim). Instructions per engine step of all threads, of
the main thread (where vLLM's engine runs and calls CUDA: VLLM_ENABLE_V1_MULTIPROCESSING=0) and
of libvgpu.so's own code, as a ratio to the run without the shim (target: within 3%). vLLM's
start-up runs under valgrind uninstrumented: a configuration takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import callgrind, frameworks  # noqa: E402
from tests.support.vllm_model import write_model  # noqa: E402

CLIENT = REPO / "tests" / "clients" / "programs" / "vllm_client.py"
CONFIGS: dict[str, list[str] | None] = {
    "no shim": None,
    "shim, quota 8Gi": ["--memory", "8Gi"],
    "shim, quota + cap 90%": ["--memory", "8Gi", "--compute", "90"],
}


def base_env(tmp: Path) -> dict[str, str]:
    return frameworks.sim_env(
        tmp,
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        VLLM_USE_FLASHINFER_SAMPLER="0",
        VLLM_USE_V2_MODEL_RUNNER="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )


def client(env: dict[str, str], vgpu: list[str] | None, wrap: list[str], *args: str) -> str:
    return frameworks.run_python(env, vgpu, str(CLIENT), *args, wrap=wrap)


def ttft(
    env: dict[str, str], vgpu: list[str] | None, model: Path, requests: int
) -> dict[str, float]:
    out = client(env, vgpu, [], str(model), "ttft", str(requests))
    m = re.search(r"ttft_ms=([\d.]+) min=([\d.]+)", out)
    if not m:
        raise SystemExit(f"no ttft_ms in the client's output: {out[-2000:]}")
    return {"median_ms": float(m.group(1)), "min_ms": float(m.group(2))}


def instructions(steps: int) -> dict[str, dict[str, float]]:
    """Instructions per engine step of one decode batch, per configuration (callgrind)."""
    callgrind.need_tools()
    result: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = write_model(tmp / "model")
        toggle = callgrind.build_toggle(tmp)
        env = base_env(tmp)
        for i, (name, vgpu) in enumerate(CONFIGS.items()):
            cg = tmp / f"cg.{i}"
            out = client(
                env, vgpu, callgrind.wrapper(cg), str(model), "decode", str(steps), str(toggle)
            )
            if f"tokens={8 * steps} " not in out:
                raise SystemExit(f"{name}: the decode batch did not finish: {out[-2000:]}")
            result[name] = callgrind.summary(cg, steps)
            print(f"callgrind {name}: {result[name]}", file=sys.stderr, flush=True)
    base = result["no shim"]
    for r in result.values():
        for k in ("all", "main"):
            r[k + "_ratio"] = r[k] / base[k]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--cg-steps", type=int, default=16, help="tokens of the counted batch")
    ap.add_argument("--only", default="ttft,instructions", help="parts: ttft, instructions")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    parts = args.only.split(",")
    if not parts or set(parts) - {"ttft", "instructions"}:
        ap.error(f"--only {args.only!r}: allowed parts are ttft and instructions, comma-separated")
    report: dict[str, object] = {}
    if "ttft" in parts:
        report["ttft"] = ttft_part(args.rounds, args.requests, args.json)
    if "instructions" in parts:
        cg = instructions(args.cg_steps)
        report["instructions"] = cg
        if not args.json:
            print(
                f"instructions per engine step, one batch of 8 x {args.cg_steps} tokens (callgrind)"
            )
            print(
                "| configuration | all threads | main thread | libvgpu.so | all / no shim | main / no shim |"
            )
            print("|---|---|---|---|---|---|")
            for name, r in cg.items():
                print(
                    f"| {name} | {r['all']:.0f} | {r['main']:.0f} | {r['shim']:.0f} | "
                    f"x{r['all_ratio']:.4f} | x{r['main_ratio']:.4f} |"
                )
    if args.json:
        print(json.dumps(report, indent=1))


def ttft_part(rounds: int, requests: int, quiet: bool) -> dict[str, object]:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = write_model(tmp / "model")
        env = base_env(tmp)
        for _ in range(rounds):
            for name, vgpu in CONFIGS.items():
                runs[name].append(ttft(env, vgpu, model, requests))
    result = {
        name: {
            "median_ms": statistics.median(r["median_ms"] for r in rs),
            "min_ms": min(r["min_ms"] for r in rs),
        }
        for name, rs in runs.items()
    }
    base = result["no shim"]
    for r in result.values():
        r["ratio_median"] = r["median_ms"] / base["median_ms"]
        r["ratio_min"] = r["min_ms"] / base["min_ms"]
    if quiet:
        return {"rounds": rounds, "requests": requests, "result": result}
    print(
        f"time to first token, {requests} requests x {rounds} rounds (median of medians, minimum)"
    )
    print("| configuration | median ms | min ms | median / no shim | min / no shim |")
    print("|---|---|---|---|---|")
    for name, r in result.items():
        print(
            f"| {name} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
            f"x{r['ratio_median']:.3f} | x{r['ratio_min']:.3f} |"
        )
    return {"rounds": rounds, "requests": requests, "result": result}


if __name__ == "__main__":
    main()

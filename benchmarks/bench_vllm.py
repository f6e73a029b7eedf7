"""vLLM on the simulated GPU: time to first token in a slice against without the shim.

    .venv/bin/python benchmarks/bench_vllm.py [--rounds 2] [--requests 30] [--json]

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
from tests.support.vllm_model import write_model  # noqa: E402

FRAMEWORKS_PYTHON = REPO / ".venv" / "frameworks" / "bin" / "python"
CLIENT = REPO / "tests" / "clients" / "programs" / "vllm_client.py"
CONFIGS: dict[str, list[str] | None] = {
    "no shim": None,
    "shim, quota 8Gi": ["--memory", "8Gi"],
    "shim, quota + cap 90%": ["--memory", "8Gi", "--compute", "90"],
}


def base_env(tmp: Path) -> dict[str, str]:
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
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        VLLM_USE_FLASHINFER_SAMPLER="0",
        VLLM_USE_V2_MODEL_RUNNER="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    return env


def ttft(
    env: dict[str, str], vgpu: list[str] | None, model: Path, requests: int
) -> dict[str, float]:
    cmd = [str(FRAMEWORKS_PYTHON), str(CLIENT), str(model), "ttft", str(requests)]
    if vgpu is not None:
        cmd = [sys.executable, "-m", "sharing.cli", "run", "--sim", *vgpu, "--", *cmd]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    m = re.search(r"ttft_ms=([\d.]+) min=([\d.]+)", r.stdout)
    if r.returncode != 0 or not m:
        raise SystemExit(
            f"{' '.join(cmd)} exited {r.returncode}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
        )
    return {"median_ms": float(m.group(1)), "min_ms": float(m.group(2))}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = write_model(tmp / "model")
        env = base_env(tmp)
        for _ in range(args.rounds):
            for name, vgpu in CONFIGS.items():
                runs[name].append(ttft(env, vgpu, model, args.requests))
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
    if args.json:
        print(
            json.dumps(
                {"rounds": args.rounds, "requests": args.requests, "result": result}, indent=1
            )
        )
        return
    print(
        f"time to first token, {args.requests} requests x {args.rounds} rounds (median of medians, minimum)"
    )
    print("| configuration | median ms | min ms | median / no shim | min / no shim |")
    print("|---|---|---|---|---|")
    for name, r in result.items():
        print(
            f"| {name} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
            f"x{r['ratio_median']:.3f} | x{r['ratio_min']:.3f} |"
        )


if __name__ == "__main__":
    main()

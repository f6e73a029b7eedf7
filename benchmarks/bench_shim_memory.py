"""Added cost of the memory shim (libvgpu.so) on the simulated GPU, against the same program
without the shim, measured in one run:

    .venv/bin/python benchmarks/bench_shim_memory.py [--n 200000] [--callgrind-n 20000] [--json]

  - per cuMemAlloc_v2 + cuMemFree_v2 pair, per cuMemGetInfo_v2, per unhooked call (cuCtxGetDevice,
    bound straight to the driver): ns (median of 5 alternating runs) and instructions
    (valgrind --tool=callgrind, the measured loop only), each as a ratio to the baseline;
    "shim, no limit" is the shim loaded with nothing to enforce (pure passthrough hooks);
  - startup: 64 processes started at once, p50/p99 of each one's first-CUDA-call shim setup
    (config, driver symbols, region open + slot claim, device map; printed by the shim at
    LIBCUDA_LOG_LEVEL=4) and the wall time of cuInit with and without the shim.
The simulated driver's calls are cheap (no kernel driver round trip), so ratios here are an upper
bound of the shim's relative cost on a real GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sharing.paths import shim_library, sim_lib_dir  # noqa: E402
from tests.support.cbuild import compile_program  # noqa: E402

MODES = ("pair", "getinfo", "unhooked")


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]


def variant_envs(work: Path) -> dict[str, dict[str, str]]:
    """The environments compared (also benchmarks/bench_startup.py): the simulated GPU with its
    state under `work`, without the shim, with it and nothing to enforce, and as in a slice."""
    state = work / "state"
    state.mkdir(exist_ok=True)
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA_", "LIBCUDA_", "VGPU_", "SIMGPU_"))
    }
    base.pop("LD_PRELOAD", None)
    base["LD_LIBRARY_PATH"] = str(sim_lib_dir())
    base["SIMGPU_STATE"] = str(state)
    return {
        "baseline": base,
        "shim, no limit": dict(base, LD_PRELOAD=str(shim_library())),
        "shim, 64 GiB quota": dict(
            base,
            LD_PRELOAD=str(shim_library()),
            CUDA_DEVICE_MEMORY_LIMIT="64Gi",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(work / "slice.region"),
        ),
    }


class Bench:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.prog = compile_program(REPO / "benchmarks" / "c" / "shim_bench.c", work, ["-O2"])
        self.envs = variant_envs(work)

    def ns(self, mode: str, env: dict[str, str], n: int, *extra: str) -> float:
        out = subprocess.run(
            [str(self.prog), mode, str(n), *extra], env=env, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        return float(re.search(r"ns_per_op=([\d.]+)", out.stdout).group(1))  # type: ignore[union-attr]

    def instructions(self, mode: str, env: dict[str, str], n: int, *extra: str) -> float:
        out_file = self.work / f"cg.{mode}.{abs(hash(tuple(sorted(env.items()))))}"
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--toggle-collect=bench_loop", f"--callgrind-out-file={out_file}",
             str(self.prog), mode, str(n), *extra],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        text = out_file.read_text()
        m = re.search(r"^summary:\s+(\d+)", text, re.M) or re.search(
            r"^totals:\s+(\d+)", text, re.M
        )
        assert m, "no callgrind summary"
        return int(m.group(1)) / (n + n // 10 + 1)  # the warm-up loop is collected too

    def startup(
        self, env: dict[str, str], procs: int = 64
    ) -> tuple[list[float], list[float], list[float]]:
        """(setup wall ns, setup cpu ns, cuInit wall ns) of `procs` processes started at once."""
        env = dict(env, LIBCUDA_LOG_LEVEL="4")
        ps = [
            subprocess.Popen(
                [str(self.prog), "init"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(procs)
        ]
        setup: list[float] = []
        cpu: list[float] = []
        init: list[float] = []
        for p in ps:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            init.append(float(out.split("=")[1]))
            for line in err.splitlines():
                if line.startswith("vgpu: setup took"):
                    setup.append(float(line.split()[-2]))
                elif line.startswith("vgpu: setup cpu"):
                    cpu.append(float(line.split()[-2]))
        return setup, cpu, init


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="iterations per timed run")
    ap.add_argument(
        "--callgrind-n", type=int, default=20_000, help="iterations under callgrind (0: skip)"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-shim-"))
    try:
        b = Bench(work)
        report: dict[str, object] = {}
        names = list(b.envs)
        for mode in MODES:
            runs: dict[str, list[float]] = {k: [] for k in names}
            for _ in range(5):  # alternate, so drift hits every variant alike
                for k in names:
                    runs[k].append(b.ns(mode, b.envs[k], args.n))
            ns = {k: statistics.median(v) for k, v in runs.items()}
            entry: dict[str, object] = {
                "ns": ns,
                "ns_ratio": {k: ns[k] / ns["baseline"] for k in names},
            }
            if args.callgrind_n and shutil.which("valgrind"):
                ins = {k: b.instructions(mode, b.envs[k], args.callgrind_n) for k in names}
                entry["instructions"] = ins
                entry["instructions_ratio"] = {k: ins[k] / ins["baseline"] for k in names}
            report[mode] = entry
        # warm: the region exists (as when the DRA driver pre-creates a claim's region, and for
        # every process of a container after its first); cold: all 64 race to create it
        setup, cpu, init_shim = b.startup(b.envs["shim, 64 GiB quota"])
        cold = dict(b.envs["shim, 64 GiB quota"])
        cold["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(work / "cold.region")
        c_setup, c_cpu, _ = b.startup(cold)
        _, _, init_base = b.startup(b.envs["baseline"])
        report["startup_64"] = {
            "shim_setup_ms_p50": pct(setup, 50) / 1e6,
            "shim_setup_ms_p99": pct(setup, 99) / 1e6,
            "shim_setup_cpu_ms_p50": pct(cpu, 50) / 1e6,
            "shim_setup_cpu_ms_p99": pct(cpu, 99) / 1e6,
            "cold_shim_setup_ms_p50": pct(c_setup, 50) / 1e6,
            "cold_shim_setup_ms_p99": pct(c_setup, 99) / 1e6,
            "cold_shim_setup_cpu_ms_p99": pct(c_cpu, 99) / 1e6,
            "cuInit_ms_p50": {
                "baseline": pct(init_base, 50) / 1e6,
                "shim": pct(init_shim, 50) / 1e6,
            },
            "cuInit_ms_p99": {
                "baseline": pct(init_base, 99) / 1e6,
                "shim": pct(init_shim, 99) / 1e6,
            },
            "processes": len(setup),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    labels = {
        "pair": "cuMemAlloc_v2+cuMemFree_v2",
        "getinfo": "cuMemGetInfo_v2",
        "unhooked": "cuCtxGetDevice (unhooked)",
    }
    for mode in MODES:
        e = report[mode]
        assert isinstance(e, dict)
        print(f"{labels[mode]}:")
        for k in names:
            line = f"  {k:20s} {e['ns'][k]:9.1f} ns  x{e['ns_ratio'][k]:.2f}"
            if "instructions" in e:
                line += f"   {e['instructions'][k]:9.0f} instr  x{e['instructions_ratio'][k]:.2f}"
            print(line)
    s = report["startup_64"]
    assert isinstance(s, dict)
    print(
        f"startup, {s['processes']} processes at once (region exists): shim setup wall p50 "
        f"{s['shim_setup_ms_p50']:.3f} ms, p99 {s['shim_setup_ms_p99']:.3f} ms; on-CPU p50 "
        f"{s['shim_setup_cpu_ms_p50']:.3f} ms, p99 {s['shim_setup_cpu_ms_p99']:.3f} ms"
    )
    print(
        f"  cold (all race to create the region): wall p50 {s['cold_shim_setup_ms_p50']:.3f} ms, "
        f"p99 {s['cold_shim_setup_ms_p99']:.3f} ms; on-CPU p99 {s['cold_shim_setup_cpu_ms_p99']:.3f} ms"
    )
    print(
        f"  cuInit wall p50 {s['cuInit_ms_p50']['baseline']:.3f} -> {s['cuInit_ms_p50']['shim']:.3f} ms, "
        f"p99 {s['cuInit_ms_p99']['baseline']:.3f} -> {s['cuInit_ms_p99']['shim']:.3f} ms (without -> with shim)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

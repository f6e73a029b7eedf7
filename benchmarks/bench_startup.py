"""Start-up cost of the shim as a user feels it: whole-process time from exec to the first
allocation (cuInit, primary context, first cuMemAlloc_v2; benchmarks/c/startup_child.c), the same
program with the shim (64 GiB quota, shared accounting file that exists, as in a slice) against
without, measured in one run. Two shim variants: "shim", a slice's file created ahead (as the
plugin does) that has learned nothing yet, recreated before every run and every round (its first
process measures a context through NVML: docs/shim.md "Contexts"; the others of a round wait for
that measurement); "shim, size handed over", the same fresh file each time with the context's size
handed over in the environment (VGPU_CONTEXT_SIZE, as `vgpu run` hands it over: the first process
charges it and verifies it through NVML on a thread of its own, off the start-up path); "shim,
size from the plugin", the same with the size in a limits file as the plugin writes it
(VGPU_CONTEXT_SIZE_0; the shim and the file read-only bind mounts, as CDI makes them: needs root,
the benchmark then runs in a mount namespace of its own; the first process charges the size and
never loads NVML), and beside it the same limits file with the size learned (its later processes:
a limits file costs every process reading it and checking its mounts); "shim, size learned", one file kept for the whole run, whose first process has already run (as in a pod
after its first process: nobody loads NVML):

    .venv/bin/python benchmarks/bench_startup.py [--single 200] [--rounds 8] [--procs 64]
        [--shim OTHER/libvgpu.so] [--before OLDER/libvgpu.so] [--json]

  - one process at a time: median over --single alternating runs of each variant;
  - --procs processes started at once (each with its own context), --rounds alternating rounds:
    p50 / p99 over every process of every round;
  - CPU time (user + system) per process, and instructions of one whole process (valgrind
    --tool=callgrind, loader included), with and without the shim: the figures that do not
    depend on the machine's load; from the CPU time, an upper bound of what 64 at once can add
    on an idle machine (were all runnable together, the median process would wait behind
    procs / 2 / CPUs others per CPU, each paying it; the launcher's spawning spreads them out);
  - --before: a second build (e.g. the previous commit's) measured alongside in the same run.
The load average is printed with the numbers: wall time on a shared machine is noisy.
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_shim_memory import pct, variant_envs  # noqa: E402
from sharing import region  # noqa: E402
from sharing.limitsfile import render_limits_file  # noqa: E402
from tests.support.cbuild import compile_program  # noqa: E402

VARIANTS = {"baseline": "baseline", "shim": "shim, 64 GiB quota"}
SHIMS = (
    "shim",
    "handed",
    "plugin",
    "learned",
    "plugin_learned",
    "before",
)  # the shim variants, in the order printed
LEARNED = "shim, size learned"
HANDED = "shim, size handed over (the slice's first process)"
PLUGIN = "shim, size from the plugin's limits file (the slice's first process)"
PLUGIN_LEARNED = "shim under the plugin's limits file, size learned (the slice's later processes)"
CONTEXT_SIZE = "500Mi"  # what a context takes on the simulator's defaults (docs/simulator.md)


def fresh_file(env: dict[str, str]) -> None:
    """Recreate the env's accounting file as the plugin creates a slice's: nothing learned."""
    path = Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    path.unlink(missing_ok=True)
    region.create(path)


def plugin_env(work: Path, shim: dict[str, str], name: str = "plugin") -> dict[str, str]:
    """The shim as the plugin installs it: a copy beside a limits file carrying the context's
    size, both read-only bind mounts (what the shim requires of the plugin's files), in a mount
    namespace of this process's own (--plugin-only runs in one: another shim there, seeing the
    plugin's mounts, would refuse to run)."""
    d = work / name
    d.mkdir()
    lib = d / "libvgpu.so"
    shutil.copy(shim["LD_PRELOAD"], lib)
    acct = d / "slice.region"
    limits = d / "limits"
    limits.write_text(
        render_limits_file(
            memory_limits=[64 * 1024**3], sm_limits=[0], policy="hard", priority=1,
            shared_cache=str(acct), context_sizes=[500 * 1024**2],
        )
    )  # fmt: skip
    for f in (lib, limits):
        subprocess.run(["mount", "--bind", "-o", "ro", str(f), str(f)], check=True)
    return dict(shim, LD_PRELOAD=str(lib), CUDA_DEVICE_MEMORY_SHARED_CACHE=str(acct))


def plugin_variant(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    """The plugin's variant, measured by this script in a mount namespace of its own
    (--plugin-only, beside its own baseline) and added to `figures` as what it adds to that
    baseline plus this run's baseline. Skipped (with a line) without root or unshare(1)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("shim, size from the plugin: skipped (needs root and unshare(1))", file=sys.stderr)
        return
    cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, __file__,
           "--plugin-only", "--json", "--single", str(args.single), "--rounds", str(args.rounds),
           "--procs", str(args.procs), "--breakdown", "0"]  # fmt: skip
    sub = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    for name, values in figures.items():
        theirs = sub[name]
        for k, ours in (("plugin", "plugin"), ("learned", "plugin_learned")):
            if k in theirs and "baseline" in values:
                values[ours] = theirs[k] - theirs["baseline"] + values["baseline"]


def spawn_at_once(
    prog: Path, env: dict[str, str], procs: int, cpu: list[float] | None = None,
    fresh: bool = False,
) -> list[float]:  # fmt: skip
    """Start `procs` processes back to back; each one's exec-to-first-allocation time (ms).
    Appends each one's CPU time (user + system, whole process, ms) to `cpu`. fresh: recreate
    the slice's accounting file first (untimed), so that nothing is learned in it."""
    if fresh:
        fresh_file(env)
    r, w = os.pipe()
    pids = []
    try:
        for _ in range(procs):
            # posix_spawn (a vfork) so the launcher adds little between the timestamp and exec
            t0 = time.monotonic_ns()
            pids.append(
                os.posix_spawn(
                    str(prog),
                    [str(prog), str(t0)],
                    env,
                    file_actions=[(os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_CLOSE, r)],
                )
            )
    finally:
        os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    for pid in pids:
        _, status, usage = os.wait4(pid, 0)
        if cpu is not None:
            cpu.append((usage.ru_utime + usage.ru_stime) * 1e3)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"startup_child failed (status {status}); output: {out!r}")
    times = [int(m) / 1e6 for m in re.findall(r"ns=(\d+)", out)]
    assert len(times) == procs, out
    return times


def breakdown_envs(work: Path, envs: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Where the shim's start-up goes, one step at a time: preloading any library, one that
    needs libdl.so.2 and libpthread.so.0 (what the shim needed before shim/src/compat.c, for
    comparison), the shim with control off (loaded, driver resolved), on with no limit, with a
    private accounting file, with the slice's shared one."""
    empty = work / "empty.c"
    empty.write_text("int vgpu_bench_empty;\n")
    libs = {}
    for name, extra in (("empty", []), ("empty_dl", ["-l:libdl.so.2", "-l:libpthread.so.0"])):
        libs[name] = work / f"lib{name}.so"
        subprocess.run(
            ["gcc", "-shared", "-fPIC", "-o", str(libs[name]), str(empty),
             "-Wl,--no-as-needed", *extra],
            check=True,
        )  # fmt: skip
    base, shim = envs["baseline"], envs["shim"]
    plain = {k: v for k, v in shim.items() if not k.startswith("CUDA_DEVICE_MEMORY_")}
    return {
        "baseline": base,
        "an empty library preloaded": dict(base, LD_PRELOAD=str(libs["empty"])),
        "(an empty one needing libdl + libpthread)": dict(base, LD_PRELOAD=str(libs["empty_dl"])),
        "shim, CUDA_DISABLE_CONTROL=1": dict(plain, CUDA_DISABLE_CONTROL="1"),
        "shim, no limit": plain,
        "shim, quota, private file": dict(plain, CUDA_DEVICE_MEMORY_LIMIT="64Gi"),
        "shim, quota, slice's file (nothing learned)": shim,
        "shim, quota, slice's file, size handed over (nothing learned)": envs["handed"],
        "shim, quota, slice's file, size learned": envs["learned"],
    }


def instructions(
    prog: Path, env: dict[str, str], work: Path, fresh: bool = False
) -> tuple[int, int]:
    """Instructions of one whole process, from the loader's first to exit: (all its threads,
    its main thread: the path to the first allocation, without the shim's verifier thread)."""
    if fresh:
        fresh_file(env)
    out_file = work / f"cg.{len(list(work.glob('cg.*')))}"
    subprocess.run(
        ["valgrind", "--tool=callgrind", "--separate-threads=yes",
         f"--callgrind-out-file={out_file}", str(prog), str(time.monotonic_ns())],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    per_thread = []
    for f in sorted(work.glob(f"{out_file.name}-*")):  # one file per thread: -01 is main
        m = re.search(r"^(?:summary|totals):\s+(\d+)", f.read_text(), re.M)
        assert m, f"no callgrind summary in {f.name}"
        per_thread.append(int(m.group(1)))
    assert per_thread, "no callgrind output"
    return sum(per_thread), per_thread[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--single", type=int, default=200, help="one-process runs per variant")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of --procs processes at once")
    ap.add_argument("--procs", type=int, default=64, help="processes started at once")
    ap.add_argument(
        "--shim", type=Path, help="another build of libvgpu.so to measure (e.g. an older commit's)"
    )
    ap.add_argument(
        "--before", type=Path, help="an older build of libvgpu.so measured alongside (same run)"
    )
    ap.add_argument(
        "--breakdown", type=int, default=300, help="runs per step of the CPU breakdown (0: skip)"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plugin-only", action="store_true", help=argparse.SUPPRESS)  # see plugin_env
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        prog = compile_program(REPO / "benchmarks" / "c" / "startup_child.c", work, ["-O2"])
        all_envs = variant_envs(work)
        envs = {k: all_envs[v] for k, v in VARIANTS.items()}
        if args.shim is not None:
            envs["shim"]["LD_PRELOAD"] = str(args.shim.resolve())
        shared = envs["shim"]["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
        envs["learned"] = dict(envs["shim"], CUDA_DEVICE_MEMORY_SHARED_CACHE=f"{shared}.learned")
        envs["handed"] = dict(
            envs["shim"],
            CUDA_DEVICE_MEMORY_SHARED_CACHE=f"{shared}.handed",
            VGPU_CONTEXT_SIZE=CONTEXT_SIZE,
        )
        if args.plugin_only:
            envs = {
                "baseline": envs["baseline"],
                "plugin": plugin_env(work, envs["shim"]),
                "learned": plugin_env(work, envs["shim"], "plugin_learned"),
            }
        if args.before is not None:
            # its own file, made by its shim (an older build may read another layout)
            envs["before"] = dict(
                envs["shim"],
                LD_PRELOAD=str(args.before.resolve()),
                CUDA_DEVICE_MEMORY_SHARED_CACHE=f"{shared}.before",
            )
            spawn_at_once(prog, envs["before"], 1)
        load_before = os.getloadavg()
        spawn_at_once(prog, envs["learned"], 1)  # the pod's first process: the size is learned
        fresh = {
            "shim",
            "handed",
            "plugin",
        }  # variants whose slice's file is recreated before every run
        single: dict[str, list[float]] = {k: [] for k in envs}
        cpu: dict[str, list[float]] = {k: [] for k in envs}
        for _ in range(args.single):  # alternate, so drift hits both alike
            for k, env in envs.items():
                single[k] += spawn_at_once(prog, env, 1, cpu[k], k in fresh)
        many: dict[str, list[float]] = {k: [] for k in envs}
        for _ in range(args.rounds):
            for k, env in envs.items():
                many[k] += spawn_at_once(prog, env, args.procs, None, k in fresh)
        steps = breakdown_envs(work, envs) if args.breakdown and not args.plugin_only else {}
        step_cpu: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(args.breakdown):
            for k, env in steps.items():
                spawn_at_once(prog, env, 1, step_cpu[k], k.endswith("(nothing learned)"))
        load_after = os.getloadavg()
        counted = (
            {k: instructions(prog, env, work, k in fresh) for k, env in envs.items()}
            if shutil.which("valgrind")
            else {}
        )
        ins = {k: v[0] for k, v in counted.items()}
        ins_main = {k: v[1] for k, v in counted.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    one = {k: statistics.median(v) for k, v in single.items()}
    cpu_mean = {k: statistics.fmean(v) for k, v in cpu.items()}
    p50 = {k: pct(v, 50) for k, v in many.items()}
    p99 = {k: pct(v, 99) for k, v in many.items()}
    if not args.plugin_only:
        plugin_variant(args, {"one_process_ms_median": one, "cpu_ms_mean": cpu_mean,
                              "at_once_ms_p50": p50, "at_once_ms_p99": p99, "instructions": ins,
                              "instructions_main_thread": ins_main})  # fmt: skip
    queue = args.procs / 2 / (os.cpu_count() or 1)  # processes ahead of the median one, per CPU
    shims = [k for k in SHIMS if k in one]
    report: dict[str, object] = {
        "one_process_ms_median": one,
        "one_process_added_ms": {k: one[k] - one["baseline"] for k in shims},
        "one_process_ratio": {k: one[k] / one["baseline"] for k in shims},
        "cpu_ms_mean": cpu_mean,
        "cpu_added_ms": {k: cpu_mean[k] - cpu_mean["baseline"] for k in shims},
        "at_once": args.procs,
        "at_once_ms_p50": p50,
        "at_once_ms_p99": p99,
        "at_once_added_ms_p50": {k: p50[k] - p50["baseline"] for k in shims},
        "at_once_added_ms_p99": {k: p99[k] - p99["baseline"] for k in shims},
        "at_once_ratio_p50": {k: p50[k] / p50["baseline"] for k in shims},
        "at_once_idle_bound_added_ms_p50": {
            k: queue * (cpu_mean[k] - cpu_mean["baseline"]) for k in shims
        },
        "cpu_ms_breakdown": {k: statistics.fmean(v) for k, v in step_cpu.items()},
        "instructions": ins,
        "instructions_ratio": {k: ins[k] / ins["baseline"] for k in shims} if ins else None,
        "instructions_main_thread": ins_main,
        "loadavg_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for k in shims:
        name = {
            "shim": "shim (nothing learned)",
            "learned": LEARNED,
            "handed": HANDED,
            "plugin": PLUGIN,
            "plugin_learned": PLUGIN_LEARNED,
        }.get(k, f"shim ({k})")
        c_add = cpu_mean[k] - cpu_mean["baseline"]
        print(f"== {name} against no shim")
        print(
            f"exec to first allocation, one process: {one['baseline']:.2f} -> {one[k]:.2f} ms "
            f"(median of {args.single}), {one[k] - one['baseline']:+.2f} ms, "
            f"x{one[k] / one['baseline']:.3f}"
        )
        print(
            f"{args.procs} at once ({args.rounds} rounds): p50 {p50['baseline']:.2f} -> "
            f"{p50[k]:.2f} ms ({p50[k] - p50['baseline']:+.2f} ms, "
            f"x{p50[k] / p50['baseline']:.3f}), p99 {p99['baseline']:.2f} -> {p99[k]:.2f} ms "
            f"({p99[k] - p99['baseline']:+.2f} ms)"
        )
        print(
            f"CPU time of one process (user + system, mean of {args.single}): "
            f"{cpu_mean['baseline']:.3f} -> {cpu_mean[k]:.3f} ms ({c_add:+.3f} ms, "
            f"x{cpu_mean[k] / cpu_mean['baseline']:.3f}); {args.procs} at once on an idle "
            f"machine add at most ~{queue:.0f} of these to the p50: {queue * c_add:+.2f} ms"
        )
        if ins:
            print(
                f"instructions of one whole process: {ins['baseline']} -> {ins[k]} "
                f"({ins[k] - ins['baseline']:+d}, x{ins[k] / ins['baseline']:.3f}); its main "
                f"thread: {ins_main['baseline']} -> {ins_main[k]} "
                f"({ins_main[k] - ins_main['baseline']:+d})"
            )
    b = report["cpu_ms_breakdown"]
    assert isinstance(b, dict)
    if b:
        print(f"CPU time per process, step by step (mean of {args.breakdown}):")
        for k, v in b.items():
            print(f"  {k:40s} {v:.3f} ms  {v - b['baseline']:+.3f}")
    print(
        f"load average (1 min) before/after: {load_before[0]:.2f} / {load_after[0]:.2f} "
        f"on {os.cpu_count()} CPUs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

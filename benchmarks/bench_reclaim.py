"""Bursting: from a new claim's prepare to its memory being free, per reclaim policy (docs/policy.md,
"Taking it back"), against a prepare that needs no reclaim, measured in the same run.

    .venv/bin/python benchmarks/bench_reclaim.py [--rounds 20] [--json]

The plugin runs in this process (the real Driver over its gRPC sockets, tests/support/
prepare_world.py) with the fake API server; the borrower is tests/c/burst_borrower.c on the
simulated GPU, started with its claim's CDI mounts (tests/support/cdi_exec.py: needs root and
unshare). Each round: claim a (20 GiB, limit 60 GiB) is prepared and its borrower started, then
claim b (40 GiB) is prepared and the NodePrepareResources call timed (the plugin answers once b's
memory is free: every borrower within its new grant); then b, the borrower and a go.

  baseline       the borrower holds only its request: nothing to take back
  evict, freed   it borrows 30 GiB and frees down to its request at the notice (SIGWINCH)
  evict, stopped it borrows 30 GiB and ignores the notice; grace 0 s: stopped at once (SIGKILL)
  wait           it borrows 30 GiB; it is stopped from outside (SIGKILL) as soon as the plugin
                 has recorded the reclaim: the figure is the plugin's side of a wait (record,
                 poll, answer) plus the stop
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sharing.paths import sim_lib_dir  # noqa: E402
from sharing.policy import BUILTIN, Burst  # noqa: E402
from tests.support import cdi_exec  # noqa: E402
from tests.support.burst_world import claim, data_dir, spec_path  # noqa: E402
from tests.support.cbuild import compile_program  # noqa: E402
from tests.support.prepare_world import World, close_world, make_world  # noqa: E402

GiB = 1024**3
VARIANTS = {
    "baseline": ("evict", 10.0, "polite", 4),
    "evict, freed": ("evict", 10.0, "polite", 10),
    "evict, stopped": ("evict", 0.0, "deaf", 10),
    "wait": ("wait", 30.0, "deaf", 10),
}


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]


def world(reclaim: str, span: float) -> World:
    b = Burst(max_ratio=4, from_claim=True, reclaim=reclaim)
    b = replace(b, timeout=span) if reclaim == "wait" else replace(b, grace=span)
    rules = replace(BUILTIN, burst=b)
    w: World = make_world(rules_for=lambda _g: rules)
    return w


def one_round(w: World, i: int, name: str, binary: Path, env: dict[str, str]) -> float:
    _policy, _span, mode, chunks = VARIANTS[name]
    a = claim(w, f"a{i}", "20Gi", "3x")
    assert w.kubelet.prepare([a])[a.uid].error == ""
    p = cdi_exec.popen(spec_path(w, a), env, [str(binary), mode, str(5 * GiB), str(chunks), "4"])
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("held"), line
    b = claim(w, f"b{i}", "40Gi")
    killer = None
    if name == "wait":
        killer = threading.Thread(target=kill_when_recorded, args=(w, p.pid))
        killer.start()
    t0 = time.perf_counter()
    err = w.kubelet.prepare([b])[b.uid].error
    took = time.perf_counter() - t0
    assert err == "", err
    if killer is not None:
        killer.join()
    assert w.kubelet.unprepare([b, a]) == {b.uid: "", a.uid: ""}
    if p.poll() is None:
        p.kill()
    p.communicate(timeout=30)
    return took


def kill_when_recorded(w: World, pid: int) -> None:
    ckpt = data_dir(w) / "checkpoint.json"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if '"reclaim"' in ckpt.read_text():
                break
        except OSError:
            pass
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("needs root and unshare(1)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="vgr", dir="/tmp"))
    binary = compile_program("burst_borrower.c", tmp)
    (tmp / "state").mkdir()
    env = dict(os.environ, LD_LIBRARY_PATH=str(sim_lib_dir()), SIMGPU_STATE=str(tmp / "state"),
               SIMGPU_CONTEXT_MEMORY="0")  # fmt: skip
    env.pop("LD_PRELOAD", None)
    worlds = {n: world(v[0], v[1]) for n, v in VARIANTS.items()}
    times: dict[str, list[float]] = {n: [] for n in VARIANTS}
    load0 = os.getloadavg()[0]
    try:
        for i in range(args.rounds):  # the variants interleaved, round by round
            for n in VARIANTS:
                times[n].append(one_round(worlds[n], i, n, binary, env))
        outcomes = {n: dict(w.plugin.driver.state.reclaims.outcomes) for n, w in worlds.items()}
    finally:
        for w in worlds.values():
            close_world(w)
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(times["baseline"])
    base99 = pct(times["baseline"], 99)
    rows: list[dict[str, Any]] = []
    for n, t in times.items():
        rows.append({"variant": n, "p50_ms": statistics.median(t) * 1e3,
                     "p99_ms": pct(t, 99) * 1e3, "x_p50": statistics.median(t) / base,
                     "x_p99": pct(t, 99) / base99})  # fmt: skip
    load1 = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"rounds": args.rounds, "load": [load0, load1], "rows": rows,
                          "outcomes": outcomes}))  # fmt: skip
        return 0
    print(f"{args.rounds} rounds, load average {load0:.1f} before, {load1:.1f} after")
    print(f"reclaim outcomes per variant: {outcomes}")
    print("| variant | p50 ms | p99 ms | x p50 | x p99 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
              f"{r['x_p50']:.2f} | {r['x_p99']:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

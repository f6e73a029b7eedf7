"""The root plugin's memory while its watchdog inspects a tenant that made its /proc files as
large as it can (issue 33, attack 1; tests/sharing/observe/test_proc_attacks.py asserts it).

    .venv/bin/python benchmarks/bench_proc_attacks.py [--modes none,maps,fds,mounts] [--json]

For each mode a fresh `vgpu-kubelet-plugin` (--metrics-address, --watchdog-enforce kill) runs on
the simulated GPU with one prepared claim; after it is warm (scrapes, NVML passes) its peak
resident memory (VmHWM) is read, a GPU process of the claim makes its files large
(tests/support/proc_attacker.py), the watchdog inspects it (its line in the log) and five more
passes run; then VmHWM is read again. Baseline, measured in the same run: mode `none`, a GPU
process of the claim with ordinary /proc files, inspected the same way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fakes.apiserver import FakeApiServer  # noqa: E402
from tests.support.observers import scrape  # noqa: E402
from tests.support.plugin_e2e import claim_world  # noqa: E402
from tests.support.proc_attacker import start_attacker  # noqa: E402

MiB = 2**20
WHAT = {
    "none": "ordinary files",
    "maps": "58,000 mappings of a 3,800-char path (~230 MB maps)",
    "fds": "descriptors past the readers' 16,384",
    "mounts": "6,000 mounts of 3,000-char points (~18 MB mountinfo)",
}


def hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def measure(mode: str) -> dict[str, float | str]:
    root = Path(tempfile.mkdtemp(prefix="vgpa", dir="/tmp"))
    attacker = None
    try:
        with FakeApiServer() as server, claim_world(server, root) as w:
            for _ in range(3):
                scrape(w.url)
                time.sleep(1)
            before = hwm_mib(w.plugin.proc.pid)
            # "name" makes ordinary files: the baseline process, inspected the same way
            attacker = start_attacker("name" if mode == "none" else mode, root / "a", w.env)
            start = time.monotonic()
            w.wait_for_line(attacker.pid)
            seen = time.monotonic() - start
            time.sleep(5)
            after = hwm_mib(w.plugin.proc.pid)
            attacker.kill()
            attacker.wait()
        return {"mode": mode, "before_mib": before, "peak_mib": after, "seen_s": seen}
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="none,maps,fds,mounts")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in WHAT]
    if bad:
        ap.error(f"--modes: {', '.join(bad)} unknown; allowed: {', '.join(WHAT)}")
    if "none" not in modes:
        modes.insert(0, "none")
    rows = []
    for m in modes:
        print(f"[bench] {m}: {WHAT[m]} ...", file=sys.stderr, flush=True)
        rows.append(measure(m))
    base = float(next(r["peak_mib"] for r in rows if r["mode"] == "none"))
    if args.json:
        print(json.dumps({"baseline_peak_mib": base, "rows": rows}, indent=2))
        return 0
    print(f"plugin peak resident memory while its watchdog inspects the process "
          f"(baseline: ordinary files, {base:.1f} MiB)")  # fmt: skip
    for r in rows:
        peak = float(r["peak_mib"])
        print(f"  {r['mode']:7} {WHAT[str(r['mode'])]:55} warm {float(r['before_mib']):6.1f} MiB  "
              f"peak {peak:6.1f} MiB  ({peak / base:.2f}x baseline)  "
              f"reported after {float(r['seen_s']):.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

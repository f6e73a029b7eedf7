"""Each process's share of device time as the driver accounts it (NVML per-process utilisation).

    python benchmarks/nvml_share.py --delay D --seconds S --device 0 [--device 1] --pid P [--pid Q]

Waits D seconds, then samples nvmlDeviceGetProcessUtilization once a second for S seconds, each
sample covering the time since the previous one, and prints one JSON object
{"<pid>": {"<device>": mean smUtil %}}. It runs against whatever libnvidia-ml.so.1 the loader
finds (the simulator's with LD_LIBRARY_PATH set), without the shim: an independent witness of
what the benchmark's workloads report about themselves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import pynvml


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay", type=float, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--device", type=int, action="append", required=True)
    ap.add_argument("--pid", type=int, action="append", required=True)
    a = ap.parse_args()
    pynvml.nvmlInit()
    handles = {d: pynvml.nvmlDeviceGetHandleByIndex(d) for d in a.device}
    samples: dict[int, dict[int, list[int]]] = {p: {d: [] for d in a.device} for p in a.pid}
    time.sleep(a.delay)
    last_us = time.time_ns() // 1000
    deadline = time.monotonic() + a.seconds
    while time.monotonic() + 1.0 <= deadline + 0.05:
        time.sleep(1.0)
        now_us = time.time_ns() // 1000
        for d, h in handles.items():
            try:
                got = pynvml.nvmlDeviceGetProcessUtilization(h, last_us)
            except pynvml.NVMLError_NotFound:
                got = []
            seen = {s.pid: int(s.smUtil) for s in got}
            for p in a.pid:
                samples[p][d].append(seen.get(p, 0))
        last_us = now_us
    pynvml.nvmlShutdown()
    out = {
        str(p): {str(d): round(statistics.mean(v), 2) if v else None for d, v in per.items()}
        for p, per in samples.items()
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

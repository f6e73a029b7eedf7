"""`vgpu info`: version, where the shim and the simulated driver are, and the GPUs NVML reports."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pynvml

from sharing import __version__
from sharing.gpus import list_gpus, use_simulator
from sharing.paths import shim_library, sim_lib_dir


def register(sub: Any) -> None:
    p = sub.add_parser("info", help="show version, library paths and the GPUs NVML reports")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--sim", action="store_true", help="report the simulated GPU instead of NVML's")
    p.set_defaults(func=run)


def collect(sim: bool) -> dict[str, Any]:
    report: dict[str, Any] = {
        "version": __version__,
        "shim": str(shim_library()),
        "sim_lib_dir": str(sim_lib_dir()),
        "gpus": [],
        "nvml_error": None,
    }
    try:
        if sim:
            use_simulator()
        report["gpus"] = [g.to_dict() for g in list_gpus()]
    except pynvml.NVMLError as e:
        report["nvml_error"] = f"NVML unavailable: {e}"
    return report


def run(args: argparse.Namespace) -> int:
    report = collect(args.sim)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"vgpu-sharing {report['version']}")
    print(f"shim:        {report['shim']}")
    print(f"sim_lib_dir: {report['sim_lib_dir']}")
    if report["nvml_error"]:
        print(report["nvml_error"])
        return 0
    for g in report["gpus"]:
        mib = g["memory_total"] // (1024 * 1024)
        print(f"GPU {g['index']}: {g['name']} {g['uuid']} {mib} MiB, sm {g['compute_capability']}")
    return 0

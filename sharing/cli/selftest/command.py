"""`vgpu selftest [--device N] [--json] [--quick] [--sim] [--shim PATH]`: the conformance run.

Runs every check of the package (environment, memory, compute, cost) on one GPU of this node,
or on the simulated GPU with --sim, and prints the report; exit 0 when every check held, 1 when
one failed, 2 on a bad argument."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from sharing.cli.selftest import compute, cost, environment, memory
from sharing.cli.selftest.probe import Runner
from sharing.cli.selftest.report import FAIL, Check, Report
from sharing.gpus import use_simulator
from sharing.paths import ArtefactMissingError

log = logging.getLogger(__name__)

GIB = 1 << 30
QUOTA = 2 * GIB  # the memory checks' slice: a few GiB, less on a GPU with less free memory
MIN_QUOTA = 1 * GIB
SECTIONS = ("environment", "memory", "compute", "cost")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "selftest",
        help="check that the sharing layer holds on this node's GPU, and print a report",
        description="Checks the driver, the shim's memory quota on every allocation route, the "
        "compute cap and the shim's cost on one GPU; exit 0 when every check holds.",
    )
    p.add_argument("--device", type=int, default=0, metavar="N",
                   help="the GPU to test, by NVML index as nvidia-smi numbers it (default 0)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quick", action="store_true",
                   help="shorter compute windows and fewer cost samples")  # fmt: skip
    p.add_argument("--sim", action="store_true", help="run on the simulated GPU")
    p.add_argument("--shim", metavar="PATH",
                   help="the libvgpu.so to test instead of the installed one (a new build)")  # fmt: skip
    p.add_argument("--only", metavar="SECTIONS",
                   help="run only these sections, comma-separated: " + ", ".join(SECTIONS)
                   + " (the environment's facts are always gathered)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.device < 0:
        print(f"vgpu selftest: --device {args.device}: must be 0 or more", file=sys.stderr)
        return 2
    sections = set(SECTIONS)
    if args.only is not None:
        sections = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = sorted(sections - set(SECTIONS))
        if unknown or not sections:
            print(f"vgpu selftest: --only {args.only!r}: allowed sections are "
                  f"{', '.join(SECTIONS)}, comma-separated", file=sys.stderr)  # fmt: skip
            return 2
    shim = None
    if args.shim is not None:
        shim = Path(args.shim).resolve()
        if not shim.is_file():
            print(f"vgpu selftest: --shim {args.shim}: no such file; give a built libvgpu.so",
                  file=sys.stderr)  # fmt: skip
            return 2
    with tempfile.TemporaryDirectory(prefix="vgpu-selftest-") as tmp:
        workdir = Path(tmp)
        if args.sim:
            # a simulated node of its own, shared by this process and the probes
            (workdir / "simgpu").mkdir()
            os.environ["SIMGPU_STATE"] = str(workdir / "simgpu")
            use_simulator()
        try:
            report = selftest(
                Runner(workdir, args.sim, shim),
                args.device,
                args.quick,
                args.sim,
                frozenset(sections),
            )
        except ArtefactMissingError as e:
            print(f"vgpu selftest: {e}", file=sys.stderr)
            return 2
    print(report.to_json() if args.json else report.to_text())
    return 0 if report.ok else 1


def selftest(
    runner: Runner,
    device: int,
    quick: bool,
    sim: bool,
    sections: frozenset[str] = frozenset(SECTIONS),
) -> Report:
    report = Report(sim=sim, device=device, quick=quick)
    facts = environment.nvml_facts(report, device)
    if not facts:  # no GPU to test: the NVML check says why
        return report
    if facts.get("mig mode") == "enabled":
        report.add(Check("environment.mig", FAIL, "MIG mode is enabled on this GPU: vgpu-sharing "
                         "does not share MIG GPUs (docs/operations.md, MIG); disable MIG or test "
                         "another --device"))  # fmt: skip
        report.environment = facts
        return report
    drv = environment.driver_api_facts(report, runner, device)
    report.environment = {
        **{k: v for k, v in facts.items() if k != "memory free"},
        "cuda (driver API)": _version(int(drv.get("cuda_driver", "0"))),
        "compute capability": drv.get("cc", "?"),
        "sms": drv.get("sms", "?"),
        "glibc": environment.glibc(),
        "page": drv.get("page", "?"),
    }
    if not drv:
        return report
    if "environment" in sections:
        environment.cudart_check(report, runner, device, int(drv.get("cuda_driver", "0")))
    else:  # its facts only: the load check stays, it is what every other check stands on
        report.checks = [c for c in report.checks if c.status == FAIL]
    quota = max(MIN_QUOTA, min(QUOTA, int(facts["memory free"]) // 4 // GIB * GIB))
    report.environment["memory quota tested"] = quota
    if "memory" in sections:
        log.info("selftest: memory routes in a %d-byte slice", quota)
        memory.check_routes(report, runner, device, quota)
    if "compute" in sections:
        log.info("selftest: compute caps")
        compute.check_caps(report, runner, device, compute.QUICK if quick else compute.FULL)
    if "cost" in sections:
        log.info("selftest: cost")
        cost.check_startup(report, runner, device, 10 if quick else 40, quota)
        cost.check_calls(report, runner, device, 2000 if quick else 20000, quota)
    return report


def _version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "?"

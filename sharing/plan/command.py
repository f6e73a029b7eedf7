"""`vgpu plan --slices PATH --workloads FILE [--json]`.

Exit codes: 0 every replica fits; 1 some replica does not; 2 bad input (one line on stderr
naming the file and the field).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

from sharing.plan.cel_eval import SelectorEvaluator
from sharing.plan.loader import InputError, load_slices, load_workloads
from sharing.plan.planner import PROGRESS_EVERY, plan, prepare
from sharing.plan.report import to_json, to_text

EXIT_FITS = 0
EXIT_SOME_UNPLACED = 1
EXIT_BAD_INPUT = 2


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="plan workloads onto ResourceSlices with the DRA allocator's rules, before deploying",
        description="Place every replica of every workload (a ResourceClaimSpec each) on the "
        "devices of the given ResourceSlices, first fit, and say why the rest does not fit. "
        "Exit 0: all fit; 1: some do not; 2: bad input.",
    )
    p.add_argument(
        "--slices",
        required=True,
        type=Path,
        action="append",
        metavar="PATH",
        help="ResourceSlices, DeviceClasses and ResourceClaims (current allocations): a "
        "YAML/JSON file or a directory of them, e.g. from `kubectl get resourceslices -o yaml` "
        "or `vgpu-kubelet-plugin --dry-run`; may be given more than once",
    )
    p.add_argument(
        "--workloads",
        required=True,
        type=Path,
        metavar="FILE",
        help="{workloads: [{name, replicas, spec: <ResourceClaimSpec>}], deviceClasses: [...]}",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _show_progress(done: int, total: int) -> None:
    """One updating line on a terminal for long plans (nothing for short ones)."""
    if total < 5 * PROGRESS_EVERY:
        return
    end = "\n" if done == total else ""
    print(f"\rvgpu plan: {done}/{total} replicas planned", end=end, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    evaluator = SelectorEvaluator()
    try:
        inventory, classes = load_slices(*args.slices)
        workloads, more = load_workloads(args.workloads)
        classes.update(more)
        claims = prepare(workloads, classes, evaluator, args.workloads)
    except InputError as e:
        print(f"vgpu plan: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # The inputs live until exit: keep the collector from rescanning them while planning
    # allocates (halves the plan time on large clusters).
    gc.freeze()
    result = plan(
        inventory, workloads, claims, evaluator, _show_progress if sys.stderr.isatty() else None
    )
    for w in result.warnings:
        print(f"vgpu plan: warning: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        sys.stdout.write(to_text(result))
    return EXIT_SOME_UNPLACED if result.unplaced else EXIT_FITS

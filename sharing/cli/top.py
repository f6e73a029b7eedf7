"""`vgpu top`: a live view of this node's GPUs and slices, refreshed every second (rich).

The same pieces as the exporter (slice discovery, NVML poller, ViewBuilder), no HTTP. The
achieved compute share is measured between two looks, so `--once` and `--json` look twice,
`--interval` apart (default 1 s), before they print.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import stat
import sys
import termios
import time
import tty
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from sharing.cli.exporter import add_discovery_flags
from sharing.gpus import use_simulator
from sharing.observe.nodeview import NodeView, SliceDeviceView, ViewBuilder
from sharing.observe.nvml_reader import NvmlPoller
from sharing.observe.slices import Slice, SliceFinder, compute_policy


def register(sub: Any) -> None:
    p = sub.add_parser(
        "top",
        help="live view of this node's GPUs and slices",
        description="Live view of this node's GPUs and slices: memory quota/used/peak, compute "
        "cap and policy/achieved, throttling, denials, processes. q or Ctrl-C quits.",
    )
    add_discovery_flags(p)
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (default 1)"
    )
    p.set_defaults(func=run)


def to_json(view: NodeView) -> dict[str, Any]:
    """The --json document (schema in docs/metrics.md and the README)."""
    return {
        "devices": [
            {
                "uuid": d.gpu.uuid,
                "name": d.gpu.name,
                "memory_total_bytes": d.gpu.memory_total,
                "memory_used_bytes": d.gpu.memory_used,
                "utilization_ratio": d.gpu.utilization,
                "slices": [
                    {
                        "claim_uid": s.slice.claim_uid,
                        "namespace": s.slice.namespace,
                        "claim": s.slice.claim,
                        "memory_limit_bytes": s.memory_limit,
                        "memory_burst_limit_bytes": s.memory_burst_limit,
                        "memory_used_bytes": s.counters.used,
                        "memory_borrowed_bytes": s.memory_borrowed,
                        "compute_limit_ratio": s.compute_limit_ratio,
                        "compute_policy": compute_policy(s.slice),
                        "compute_used_ratio": round(s.compute_used_ratio, 4),
                        "alloc_denied_total": s.counters.denials,
                        "processes": s.processes,
                        "untrusted": s.untrusted,
                    }
                    for s in d.slices
                ],
            }
            for d in view.devices
        ],
        "unreadable": [
            {
                "claim_uid": u.slice.claim_uid,
                "namespace": u.slice.namespace,
                "claim": u.slice.claim,
                "reason": u.reason,
            }
            for u in view.unreadable
        ],
    }


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{100 * r:.0f}%"


def _bytes(n: int) -> str:
    """Compact binary units for narrow terminals: 512K, 100M, 4.0G."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return str(n)


_COLUMNS = ("quota", "used", "peak", "cap", "got", "held", "launches", "denied", "procs")
_NAME_WIDTH = (12, 32)  # the name column's narrowest and widest


def _label(sl: Slice) -> str:
    # a --region slice is named by its file: its name is enough on screen
    return f"{sl.namespace}/{sl.claim}" if sl.namespace else Path(sl.claim).name


def _cap(s: SliceDeviceView) -> str:
    """The cap column: the slice's SM cap and its compute policy (its limits file's), which
    decides what the cap means: `30%` hard, `30%+` elastic (may use idle SMs beyond it), `off`
    (the policy lifts the cap), `none` (no cap: the whole GPU, or limits unknown). One column,
    not two: at 80 columns every figure stays whole."""
    policy = compute_policy(s.slice)
    if policy == "off":
        return "[red]off[/red]"
    if not s.compute_limit_ratio:
        return "none"
    return _pct(s.compute_limit_ratio) + ("+" if policy == "elastic" else "")


_CAP_NOTE = "cap 30%+: elastic (may use idle SMs beyond it); off: compute policy off, no cap"


def render(view: NodeView, width: int = 0) -> Group:
    """The table; on a terminal `width` columns wide (0: the console's), the figures keep their
    full width and the names are cut (…) to fit."""
    rows: list[tuple[str, ...]] = []
    # a borrowed column after used where a slice bursts (docs/policy.md); left out otherwise, so
    # the usual table keeps its width
    bursting = any(s.memory_burst_limit for d in view.devices for s in d.slices)
    columns = (*_COLUMNS[:2], "borrowed", *_COLUMNS[2:]) if bursting else _COLUMNS

    def lent(cells: tuple[str, ...], borrowed: str) -> tuple[str, ...]:
        return (*cells[:3], borrowed, *cells[3:]) if bursting else cells

    for d in view.devices:
        g = d.gpu
        name = f"GPU {g.index} {g.name}".strip() if g.index >= 0 else g.uuid
        name = name.replace("NVIDIA ", "")
        state = "" if g.healthy else " [red](no NVML)[/red]"
        device_borrowed = sum(s.memory_borrowed for s in d.slices)
        row = lent(
            (
                f"[bold]{name}[/bold]{state}",
                _bytes(g.memory_total),
                _bytes(g.memory_used),
                "",
                f"{100 * d.cores_allocated_ratio:.0f}%",
                f"{_pct(g.utilization)}",
                "",
                "",
                "",
                str(sum(s.processes for s in d.slices)),
            ),
            _bytes(device_borrowed) if any(s.memory_burst_limit for s in d.slices) else "",
        )
        rows.append(row)
        for s in d.slices:
            c = s.counters
            # clamped figures of a slice whose file claimed the impossible: marked, not believed
            bang = "[red]![/red]" if s.untrusted else ""
            rows.append(
                lent(
                    (
                        f"  {_label(s.slice)}{' [red](untrusted)[/red]' if s.untrusted else ''}",
                        _bytes(s.memory_limit),
                        _bytes(c.used) + bang,
                        _bytes(c.peak) + bang,
                        _cap(s),
                        _pct(s.compute_used_ratio),
                        f"{c.wait_ns / 1e9:.1f}s",
                        str(c.launches),
                        str(c.denials),
                        str(s.processes),
                    ),
                    _bytes(s.memory_borrowed) + bang if s.memory_burst_limit else "",
                )
            )
    for u in view.unreadable:
        rows.append((f"  {_label(u.slice)} [red](unreadable)[/red]", *[""] * len(columns)))
    if not view.devices and not view.unreadable:
        rows.append(("no GPUs or slices found", *[""] * len(columns)))
    figures = [
        max([len(col), *(Text.from_markup(r[i + 1]).cell_len for r in rows)])
        for i, col in enumerate(columns)
    ]
    # Two spaces between columns and one at each edge of the table.
    room = (width or Console().width) - sum(figures) - 2 * len(columns) - 2
    t = Table(
        title="vgpu top  (got: achieved compute share; held: time launches waited for the cap)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    t.add_column(
        "GPU / slice",
        no_wrap=True,
        overflow="ellipsis",
        min_width=_NAME_WIDTH[0],
        max_width=max(_NAME_WIDTH[0], min(_NAME_WIDTH[1], room)),
    )
    for col, w in zip(columns, figures, strict=True):
        t.add_column(col, justify="right", no_wrap=True, min_width=w)
    for row in rows:
        t.add_row(*row)
    notes = [Text(e, style="yellow") for e in view.errors if e != "no NVML reading yet"]
    policies = {compute_policy(s.slice) for d in view.devices for s in d.slices}
    if policies & {"elastic", "off"}:  # the cap column then means more than a hard cap
        notes.insert(0, Text(_CAP_NOTE, style="dim"))
    return Group(t, *notes)


class _Keys:
    """Single key presses from the terminal (q quits), without Enter or echo; where stdin is not
    a terminal, wait() only waits."""

    def __init__(self) -> None:
        self._fd = -1
        self._saved: list[Any] | None = None

    def __enter__(self) -> _Keys:
        try:
            if sys.stdin.isatty():
                self._fd = sys.stdin.fileno()
                self._saved = termios.tcgetattr(self._fd)
                tty.setcbreak(self._fd)
        except (OSError, ValueError, termios.error):
            self._fd, self._saved = -1, None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def wait(self, seconds: float) -> str:
        """The key pressed within `seconds` ("" when none)."""
        if self._saved is None:
            time.sleep(seconds)
            return ""
        ready, _, _ = select.select([self._fd], [], [], seconds)
        return os.read(self._fd, 1).decode(errors="replace") if ready else ""


def _region_problem(path: str) -> str:
    """Why a --region FILE cannot be shown ("" when it can): a mistyped path is said, not
    shown as an empty node."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{e.strerror or e} (give the accounting file of a `vgpu run --region` slice)"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (give the accounting file of a `vgpu run --region` slice)"
    return ""


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("vgpu top: --interval must be a positive number of seconds", file=sys.stderr)
        return 2
    for path in args.region:
        problem = _region_problem(path)
        if problem:
            print(f"vgpu top: --region {path}: {problem}", file=sys.stderr)
            return 2
    if args.sim:
        use_simulator()
    poller = NvmlPoller(interval=min(args.interval, 1.0))
    poller.start()
    view = ViewBuilder(SliceFinder(args.data_dir, args.region), poller.latest)
    try:
        if args.once or args.json:
            view.build()  # first look: the achieved share is measured from here
            time.sleep(args.interval)
            snap = view.build()
            if args.json:
                print(json.dumps(to_json(snap), indent=2))
            else:
                Console().print(render(snap))
            return 0
        with Live(render(view.build()), auto_refresh=False, screen=False) as live, _Keys() as keys:
            while True:
                deadline = time.monotonic() + args.interval
                while (left := deadline - time.monotonic()) > 0:
                    if keys.wait(left) in ("q", "Q"):
                        return 0
                live.update(render(view.build()), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        poller.stop()

"""The plan as a text table (for people) and as JSON (for tools)."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from typing import Any

from sharing.kubequantity import format_quantity
from sharing.plan.planner import Plan


def _amounts(device_caps: dict[str, Any], values: dict[str, Decimal]) -> dict[str, str]:
    """Published capacity name -> quantity text, in name order."""
    out = {device_caps[q].name: format_quantity(v) for q, v in values.items()}
    return dict(sorted(out.items()))


def to_json(plan: Plan) -> dict[str, Any]:
    return {
        "placed": [
            {
                "workload": p.workload,
                "replica": p.replica,
                "node": p.node,
                "device": pl.device.name,
                "consumed": _amounts(pl.device.capacity, pl.consumed),
            }
            for p in plan.placed
            for pl in p.placements
        ],
        "unplaced": [
            {"workload": u.workload, "replica": u.replica, "reason": u.reason}
            for u in plan.unplaced
        ],
        "devices": [
            {"node": d.node, "device": d.name, "free": _amounts(d.capacity, free)}
            for d, free in plan.devices
        ],
    } | _burst_json(plan)


def _burst_json(plan: Plan) -> dict[str, Any]:
    if not plan.burst:
        return {}
    return {"burst": [
        {"node": d.node, "device": d.name, "headroom": format_quantity(h),
         "pool": format_quantity(pool), "could_add": format_quantity(min(h, pool))}
        for d, h, pool in plan.burst
    ]}  # fmt: skip


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
    return lines


def _kv(amounts: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in amounts.items()) or "-"


def to_text(plan: Plan) -> str:
    out: list[str] = []
    rows = [
        [
            p.workload,
            str(p.replica),
            p.node,
            pl.device.name,
            pl.request,
            _kv(_amounts(pl.device.capacity, pl.consumed)),
        ]
        for p in plan.placed
        for pl in p.placements
    ]
    out.append(f"PLACED ({len({(p.workload, p.replica) for p in plan.placed})} replicas)")
    if rows:
        out += _table(["WORKLOAD", "REPLICA", "NODE", "DEVICE", "REQUEST", "CONSUMED"], rows)
    out.append("")
    out.append(f"NOT PLACED ({len(plan.unplaced)} replicas)")
    if plan.unplaced:
        out += _table(
            ["WORKLOAD", "REPLICA", "REASON"],
            [[u.workload, str(u.replica), u.reason] for u in plan.unplaced],
        )
    out.append("")
    out.append("DEVICES")
    if plan.devices:
        out += _table(
            ["NODE", "DEVICE", "FREE"],
            [[d.node, d.name, _kv(_amounts(d.capacity, free))] for d, free in plan.devices],
        )
    if plan.burst:
        out.append("")
        out.append("BURST (the plan counts requests only; what memoryLimit could add)")
        out += _table(
            ["NODE", "DEVICE", "HEADROOM", "POOL", "COULD ADD"],
            [[d.node, d.name, format_quantity(h), format_quantity(pool),
              format_quantity(min(h, pool))] for d, h, pool in plan.burst],
        )  # fmt: skip
    out.append("")
    out.append("SUMMARY")
    placed = Counter(p.workload for p in plan.placed)
    out += _table(
        ["WORKLOAD", "REPLICAS", "PLACED", "NOT PLACED"],
        [[name, str(n), str(placed[name]), str(n - placed[name])] for name, n in plan.workloads],
    )
    return "\n".join(out) + "\n"

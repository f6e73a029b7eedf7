"""Workloads over nodes, first fit, and why the rest did not fit.

Order (documented in docs/plan.md): workloads as listed, replicas 0..n-1; each replica is one
claim placed on the first node (by name) where the allocator finds devices for all of its
requests. A replica that fits nowhere is reported with the reason of its request that fits
worst. Allocation only ever consumes, so a claim that did not fit on a node never fits there
later: each workload keeps a cursor of the first node still worth trying (the plan is the
same as trying every node from the first, only faster).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from sharing.kubequantity import format_quantity
from sharing.plan.allocator import Allocator, Alternative, Placement, PreparedClaim, Usage
from sharing.plan.cel_eval import CelError, Selector, SelectorEvaluator
from sharing.plan.loader import InputError
from sharing.plan.model import Allocated, Device, DeviceClass, Inventory, Workload, qualify

PROGRESS_EVERY = 1000  # replicas between progress reports


@dataclass(frozen=True)
class Placed:
    workload: str
    replica: int
    node: str
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class Unplaced:
    workload: str
    replica: int
    reason: str


@dataclass
class Plan:
    placed: list[Placed] = field(default_factory=list)
    unplaced: list[Unplaced] = field(default_factory=list)
    devices: list[tuple[Device, dict[str, Decimal]]] = field(default_factory=list)  # free
    warnings: list[str] = field(default_factory=list)
    workloads: list[tuple[str, int]] = field(default_factory=list)  # (name, replicas) in order
    # per device: (device, what its placed bursting claims may use above their requests, its
    # free memory): bursting could add min(the two); planning counts requests only
    burst: list[tuple[Device, Decimal, Decimal]] = field(default_factory=list)


def _burst(plan: Plan, workloads: dict[str, Workload]) -> list[tuple[Device, Decimal, Decimal]]:
    """What bursting could add per device (docs/policy.md): the placed claims' headroom above
    their memory requests (a VgpuConfig memoryLimit in their spec), and the device's free memory,
    which is the pool they borrow from."""
    headroom: dict[tuple[str, str, str], Decimal] = {}
    for p in plan.placed:
        spec = workloads[p.workload].spec
        for pl in p.placements:
            limit = spec.burst_limit(pl.request)
            memory = next((v for q, v in pl.consumed.items()
                           if pl.device.capacity[q].name == "memory"), None)  # fmt: skip
            if limit is None or memory is None:
                continue
            extra = max(Decimal(0), limit.of(memory) - memory)
            headroom[pl.device.key] = headroom.get(pl.device.key, Decimal(0)) + extra
    out = []
    for d, free in plan.devices:
        if d.key in headroom:
            mem = next((v for q, v in free.items() if d.capacity[q].name == "memory"), Decimal(0))
            out.append((d, headroom[d.key], mem))
    return out


def prepare(
    workloads: Sequence[Workload],
    classes: dict[str, DeviceClass],
    evaluator: SelectorEvaluator,
    file: Path,
) -> list[PreparedClaim]:
    """Each workload's claim with classes resolved and selectors compiled (InputError if not)."""
    out: list[PreparedClaim] = []
    for wi, w in enumerate(workloads):
        reqs: list[tuple[Alternative, ...]] = []
        for ri, r in enumerate(w.spec.requests):
            alts: list[Alternative] = []
            for ai, dr in enumerate(r.alternatives):
                where = f"workloads[{wi}].spec.devices.requests[{ri}]." + (
                    "exactly"
                    if len(r.alternatives) == 1 and "/" not in dr.name
                    else f"firstAvailable[{ai}]"
                )
                dc = classes.get(dr.device_class)
                if dc is None:
                    known = ", ".join(sorted(classes)) or "none given"
                    raise InputError(
                        file,
                        f"{where}.deviceClassName",
                        f"DeviceClass {dr.device_class!r} not found (known: {known}); give "
                        "DeviceClasses with --slices or under deviceClasses: in this file",
                    )
                class_sel = _compile(evaluator, dc.selectors, dc.file or file, dc.path)
                sels = _compile(evaluator, dr.selectors, file, f"{where}.selectors")
                base, _, sub = dr.name.partition("/")
                alts.append(Alternative(dr, base, sub or None, dc.name, class_sel, sels))
            reqs.append(tuple(alts))
        out.append(PreparedClaim(tuple(reqs), w.spec.constraints))
    return out


def _compile(
    evaluator: SelectorEvaluator, expressions: tuple[str, ...], file: Path | str, path: str
) -> tuple[Selector, ...]:
    out = []
    for i, expr in enumerate(expressions):
        try:
            out.append(evaluator.compile(expr))
        except CelError as e:
            raise InputError(file, f"{path}[{i}].cel.expression", str(e)) from None
    return tuple(out)


def plan(
    inventory: Inventory,
    workloads: Sequence[Workload],
    claims: Sequence[PreparedClaim],
    evaluator: SelectorEvaluator,
    progress: Callable[[int, int], None] | None = None,
) -> Plan:
    """The plan; `progress(done, total)` is called every PROGRESS_EVERY replicas and at the end."""
    all_devices = [d for devs in inventory.nodes.values() for d in devs]
    total = sum(w.replicas for w in workloads)
    done = 0
    usage = Usage(all_devices)
    alloc = Allocator(evaluator, usage)
    nodes = list(inventory.nodes.items())
    result = Plan(
        warnings=list(inventory.warnings), workloads=[(w.name, w.replicas) for w in workloads]
    )
    result.warnings += apply_allocated(inventory.allocated, all_devices, usage)
    for w, claim in zip(workloads, claims, strict=True):
        cursor = 0
        reason: str | None = None
        for replica in range(w.replicas):
            done += 1
            if progress is not None and done % PROGRESS_EVERY == 0:
                progress(done, total)
            placed = None
            while cursor < len(nodes):
                node, devices = nodes[cursor]
                picks = alloc.allocate(claim, devices)
                if picks is not None:
                    usage.commit(picks)
                    placed = Placed(w.name, replica, node, tuple(picks))
                    break
                cursor += 1
            if placed is not None:
                result.placed.append(placed)
                continue
            if reason is None:
                reason = diagnose(claim, nodes, alloc)
            result.unplaced.append(Unplaced(w.name, replica, reason))
    if alloc.budget_exhausted:
        result.warnings.append(
            "the search for some claim on some node was cut short (too many device "
            "combinations); that claim was treated as not fitting there"
        )
    result.devices = [(d, usage.free(d)) for d in all_devices]
    result.burst = _burst(result, {w.name: w for w in workloads})
    if progress is not None:
        progress(total, total)
    return result


def apply_allocated(
    allocated: Sequence[Allocated], devices: Sequence[Device], usage: Usage
) -> list[str]:
    """Start from existing claims' allocations; warnings for devices the slices lack."""
    by_key = {d.key: d for d in devices}
    warnings = []
    for a in allocated:
        d = by_key.get((a.driver, a.pool, a.device))
        if d is None:
            warnings.append(
                f"claim {a.claim}: allocated device {a.driver}/{a.pool}/{a.device} is not in "
                "the slices; left out"
            )
            continue
        if d.allow_multiple and a.consumed is not None:
            consumed = {qualify(k, d.driver): v for k, v in a.consumed.items()}
            usage.commit([Placement("", d, {q: v for q, v in consumed.items() if q in d.capacity})])
        else:
            usage.taken[d.index] = True
    return warnings


def diagnose(
    claim: PreparedClaim, nodes: Sequence[tuple[str, list[Device]]], alloc: Allocator
) -> str:
    """Why the claim fits on no node: the first request no device can serve, with why the
    devices refused it; else the device count, the constraints, or the combination."""
    usage = alloc.usage
    for alts in claim.requests:
        why: list[str] = []
        for alt in alts:
            reasons: Counter[str] = Counter()
            max_free: dict[str, Decimal] = {}
            top = 0  # most usable devices on one node
            whole_nodes = 0  # nodes where every matching device is usable (for All)
            for _, devices in nodes:
                usable = matched = 0
                for d in devices:
                    sel = alt_reason_selectable(alloc, alt, d)
                    if sel is not None:
                        reasons[sel] += 1
                        continue
                    matched += 1
                    fit = alloc.demand(alt, d)
                    if fit.reason is not None:
                        reasons[fit.reason] += 1
                        continue
                    if usage.taken[d.index]:
                        reasons["taken whole by another claim"] += 1
                        continue
                    if d.allow_multiple and not alloc.has_room(fit, d, {}):
                        free = usage.free(d)
                        short = [q for q, a in fit.consumed.items() if a > free[q]]
                        q = short[0]
                        cap = d.capacity[q]
                        reasons[
                            f"not enough {cap.name} left (needs {format_quantity(fit.consumed[q])})"
                        ] += 1
                        if q not in max_free or free[q] > max_free[q]:
                            max_free[q] = free[q]
                        continue
                    usable += 1
                top = max(top, usable)
                whole_nodes += matched > 0 and usable == matched
            if alt.request.mode == "All":
                if whole_nodes:
                    why = []
                    break
                why.append(_explain(alt, reasons, max_free, 0, 1, all_mode=True))
            elif top >= alt.request.count:
                why = []
                break
            else:
                why.append(_explain(alt, reasons, max_free, top, alt.request.count))
        if why:
            return "; ".join(why)
    if claim.constraints:
        parts = []
        for c in claim.constraints:
            kind = "matchAttribute" if c.match_attribute else "distinctAttribute"
            attr = c.match_attribute or c.distinct_attribute
            reqs = ", ".join(c.requests) if c.requests else "all requests"
            parts.append(f"{kind} {attr} ({reqs})")
        return "no node has devices for every request that also satisfy " + "; ".join(parts)
    return "no single node has room for all requests of the claim together"


def alt_reason_selectable(alloc: Allocator, alt: Alternative, d: Device) -> str | None:
    r = alloc.selectable(alt, d)
    if r is True:
        return None
    if isinstance(r, str):
        return r
    # Which selector refused: the class's or the request's.
    for i, sel in enumerate(alt.class_selectors):
        if alloc.evaluator.matches(sel, d) is not True:
            return f"DeviceClass {alt.class_name} selector #{i} is false"
    for i, sel in enumerate(alt.selectors):
        if alloc.evaluator.matches(sel, d) is not True:
            return f"selector #{i} is false"
    return "not selectable"  # pragma: no cover - one of the selectors refused


def _explain(
    alt: Alternative,
    reasons: Counter[str],
    max_free: dict[str, Decimal],
    top: int,
    need: int,
    *,
    all_mode: bool = False,
) -> str:
    name = alt.request.name
    if all_mode and reasons:
        detail = ", ".join(f"{n} device(s): {r}" for r, n in reasons.most_common(3))
        return (
            f"request {name}: allocationMode All needs every matching device of a node, and "
            f"no node has them all free ({detail})"
        )
    if top > 0:
        return f"request {name}: needs {need} devices, at most {top} usable on one node"
    if not reasons:
        return f"request {name}: the slices hold no devices"
    detail = ", ".join(f"{n} device(s): {r}" for r, n in reasons.most_common(3))
    if max_free:
        left = ", ".join(
            f"{q.rpartition('/')[2]} {format_quantity(v)}" for q, v in sorted(max_free.items())
        )
        detail += f"; the most left on one device: {left}"
    return f"request {name}: no device can serve it ({detail})"

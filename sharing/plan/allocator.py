"""One claim on one node, searched the way the DRA allocator searches.

Requests are satisfied in order; a `firstAvailable` request tries its subrequests in order and
takes the first that works. An ExactCount request takes `count` distinct devices, tried as
combinations in the node's device order (never permutations); an All request needs every
device of the node that its selectors match. Each candidate must be free (a device without
allowMultipleAllocations is taken whole, by one request of one claim), fit the consumable
capacity left (capacity.py) and satisfy the claim's constraints (matchAttribute: one value
across the constrained requests' devices; distinctAttribute: all different); when a later
request cannot be satisfied, earlier choices are revisited (backtracking).

Selector results and per-device demand never change during a plan, so both are cached per
(alternative, device).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from itertools import count

from sharing.plan.capacity import Fit, demand
from sharing.plan.cel_eval import Selector, SelectorEvaluator
from sharing.plan.model import (
    AttrValue,
    Constraint,
    Device,
    DeviceRequest,
    Taint,
    Toleration,
    qualify,
)

SEARCH_BUDGET = 200_000  # device additions tried for one claim on one node before giving up

_uids = count()


@dataclass(frozen=True)
class Alternative:
    """A request (or subrequest) with its class and selectors compiled."""

    request: DeviceRequest
    base: str  # the claim's request name
    sub: str | None  # the subrequest name for firstAvailable
    class_name: str
    class_selectors: tuple[Selector, ...]
    selectors: tuple[Selector, ...]
    uid: int = field(default_factory=lambda: next(_uids))


@dataclass(frozen=True)
class PreparedClaim:
    requests: tuple[tuple[Alternative, ...], ...]
    constraints: tuple[Constraint, ...]


@dataclass(frozen=True)
class Placement:
    request: str
    device: Device
    consumed: dict[str, Decimal]  # qualified capacity name -> amount


class Usage:
    """What is allocated so far: consumed capacity of shared devices, devices taken whole."""

    def __init__(self, devices: Sequence[Device]) -> None:
        self.used: list[dict[str, Decimal]] = [{} for _ in devices]
        self.taken: list[bool] = [False] * len(devices)

    def free(self, device: Device) -> dict[str, Decimal]:
        if self.taken[device.index]:
            return {q: Decimal(0) for q in device.capacity}
        used = self.used[device.index]
        return {q: c.value - used.get(q, Decimal(0)) for q, c in device.capacity.items()}

    def commit(self, placements: Sequence[Placement]) -> None:
        for p in placements:
            d = p.device
            if d.allow_multiple:
                used = self.used[d.index]
                for q, amount in p.consumed.items():
                    used[q] = used.get(q, Decimal(0)) + amount
            else:
                self.taken[d.index] = True


def untolerated(device: Device, tolerations: tuple[Toleration, ...]) -> Taint | None:
    """The first taint that keeps new allocations off the device for this request."""
    for t in device.taints:
        if t.effect in ("NoSchedule", "NoExecute") and not any(
            tol.tolerates(t) for tol in tolerations
        ):
            return t
    return None


def applies(constraint: Constraint, alt: Alternative) -> bool:
    if not constraint.requests:
        return True
    names = constraint.requests
    return alt.base in names or (alt.sub is not None and f"{alt.base}/{alt.sub}" in names)


def lookup_attribute(device: Device, name: str) -> AttrValue | None:
    """A constraint's attribute (fully qualified in the claim) on a device."""
    return device.attributes.get(qualify(name, device.driver))


class _Constraints:
    """Running state of a claim's constraints while devices are added and removed."""

    def __init__(self, constraints: tuple[Constraint, ...]) -> None:
        self.constraints = constraints
        self.values: list[list[AttrValue]] = [[] for _ in constraints]

    def add(self, alt: Alternative, device: Device) -> bool:
        added: list[int] = []
        for k, c in enumerate(self.constraints):
            if not applies(c, alt):
                continue
            attr = c.match_attribute or c.distinct_attribute
            assert attr is not None
            value = lookup_attribute(device, attr)
            have = self.values[k]
            ok = value is not None and (
                (c.match_attribute is not None and (not have or have[0] == value))
                or (c.distinct_attribute is not None and value not in have)
            )
            if not ok:
                for j in added:
                    self.values[j].pop()
                return False
            assert value is not None
            have.append(value)
            added.append(k)
        return True

    def remove(self, alt: Alternative) -> None:
        for k, c in enumerate(self.constraints):
            if applies(c, alt):
                self.values[k].pop()


class Allocator:
    """Allocates claims node by node against one Usage."""

    def __init__(self, evaluator: SelectorEvaluator, usage: Usage) -> None:
        self.evaluator = evaluator
        self.usage = usage
        self._selectable: dict[tuple[int, int], bool | str] = {}
        self._demand: dict[tuple[int, int], Fit] = {}
        self.budget_exhausted = False

    # -- static per (alternative, device) --

    def selectable(self, alt: Alternative, device: Device) -> bool | str:
        """True, False, or a CEL runtime error (not selectable either)."""
        key = (alt.uid, device.index)
        got = self._selectable.get(key)
        if got is not None:
            return got
        result: bool | str = True
        for sel in alt.class_selectors + alt.selectors:
            r = self.evaluator.matches(sel, device)
            if r is not True:
                result = r
                break
        self._selectable[key] = result
        return result

    def demand(self, alt: Alternative, device: Device) -> Fit:
        """What one allocation consumes, or why the device refuses the request (a taint the
        request does not tolerate, a capacity policy)."""
        key = (alt.uid, device.index)
        got = self._demand.get(key)
        if got is None:
            taint = untolerated(device, alt.request.tolerations)
            if taint is not None:
                got = Fit({}, f"taint {taint.key}={taint.value}:{taint.effect} not tolerated")
            else:
                got = demand(alt.request.capacity, device)
            self._demand[key] = got
        return got

    def has_room(self, fit: Fit, device: Device, allocating: dict[int, dict[str, Decimal]]) -> bool:
        used = self.usage.used[device.index]
        extra = allocating.get(device.index)
        zero = Decimal(0)
        for q, amount in fit.consumed.items():
            total = used.get(q, zero) + amount
            if extra:
                total += extra.get(q, zero)
            if total > device.capacity[q].value:
                return False
        return True

    # -- the search --

    def allocate(self, claim: PreparedClaim, devices: Sequence[Device]) -> list[Placement] | None:
        """The placements of the claim on these devices (one node), or None if it does not fit."""
        picks: list[Placement] = []
        allocating: dict[int, dict[str, Decimal]] = {}
        taking: set[int] = set()
        cons = _Constraints(claim.constraints)
        budget = [SEARCH_BUDGET]
        usage = self.usage

        def add(alt: Alternative, d: Device) -> Callable[[], None] | None:
            budget[0] -= 1
            if budget[0] < 0:
                self.budget_exhausted = True
                return None
            # Held whole: by an earlier claim, an existing allocation, or this claim.
            if usage.taken[d.index] or d.index in taking:
                return None
            fit = self.demand(alt, d)
            if fit.reason is not None:
                return None
            if d.allow_multiple and not self.has_room(fit, d, allocating):
                return None
            if not cons.add(alt, d):
                return None
            if d.allow_multiple:
                extra = allocating.setdefault(d.index, {})
                for q, amount in fit.consumed.items():
                    extra[q] = extra.get(q, Decimal(0)) + amount
                consumed = fit.consumed
            else:
                taking.add(d.index)
                consumed = {q: c.value for q, c in d.capacity.items()}
            picks.append(Placement(alt.request.name, d, consumed))

            def undo() -> None:
                picks.pop()
                cons.remove(alt)
                if d.allow_multiple:
                    extra = allocating[d.index]
                    for q, amount in fit.consumed.items():
                        extra[q] -= amount
                else:
                    taking.discard(d.index)

            return undo

        def request(i: int) -> bool:
            if i == len(claim.requests):
                return True
            for alt in claim.requests[i]:
                cands = [d for d in devices if self.selectable(alt, d) is True]
                if alt.request.mode == "All":
                    if cands and take_all(alt, cands, 0, i):
                        return True
                elif choose(alt, cands, 0, alt.request.count, i):
                    return True
                if budget[0] < 0:
                    return False
            return False

        def take_all(alt: Alternative, cands: list[Device], j: int, i: int) -> bool:
            if j == len(cands):
                return request(i + 1)
            undo = add(alt, cands[j])
            if undo is None:
                return False
            if take_all(alt, cands, j + 1, i):
                return True
            undo()
            return False

        def choose(alt: Alternative, cands: list[Device], start: int, left: int, i: int) -> bool:
            if left == 0:
                return request(i + 1)
            for j in range(start, len(cands) - left + 1):
                undo = add(alt, cands[j])
                if undo is None:
                    if budget[0] < 0:
                        return False
                    continue
                if choose(alt, cands, j + 1, left - 1, i):
                    return True
                undo()
            return False

        return list(picks) if request(0) else None

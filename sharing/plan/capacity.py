"""Consumable capacity as the DRA allocator computes it (KEP-5075, resource.k8s.io/v1).

For every capacity of a device, one allocation consumes:
  * the requested amount rounded up to a valid value of the capacity's requestPolicy
    (validRange: min + k*step, never below min; validValues: the next listed value), or
  * when the request names no amount: the policy's default, else the whole capacity.
The device does not match when the consumed amount violates the policy (above
validRange.max, not a step multiple from min, not among validValues; the default itself is
always accepted) or when a requested capacity is not one the device has. A device with
allowMultipleAllocations is shared until a capacity would exceed its value; a device without
it is taken whole by one allocation, which must still fit its capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from sharing.kubequantity import format_quantity
from sharing.plan.model import Capacity, Device, RequestPolicy, qualify


def consumed_amount(requested: Decimal | None, cap: Capacity) -> Decimal:
    """What one allocation consumes of `cap` for this request amount (None: not named)."""
    policy = cap.policy
    if requested is None:
        if policy is not None and policy.default is not None:
            return policy.default
        return cap.value
    if policy is None:
        return requested
    vr = policy.valid_range
    if vr is not None:
        if requested < vr.min:
            return vr.min
        if vr.step is None:
            return requested
        steps = math.ceil((requested - vr.min) / vr.step)
        return vr.min + vr.step * steps
    if policy.valid_values:
        for v in policy.valid_values:
            if requested <= v:
                return v
    return requested


def violates(amount: Decimal, policy: RequestPolicy | None) -> str | None:
    """Why `amount` is refused by the policy (a short phrase), or None if it is accepted."""
    if policy is None or (policy.default is not None and amount == policy.default):
        return None
    vr = policy.valid_range
    if vr is not None:
        if vr.max is not None and amount > vr.max:
            return "above validRange.max"
        if vr.step is not None and (amount - vr.min) % vr.step != 0:
            return "not min + a multiple of validRange.step"
        return None
    if policy.valid_values and amount not in policy.valid_values:
        return "above every validValues entry"
    return None


@dataclass(frozen=True)
class Fit:
    """Per capacity (qualified name): what the allocation consumes. `reason` when refused."""

    consumed: dict[str, Decimal]
    reason: str | None = None
    capacity: str | None = None  # the capacity the refusal is about


def resolve_requests(
    requests: tuple[tuple[str, Decimal], ...], device: Device
) -> dict[str, Decimal] | str:
    """Requested amounts keyed by the device's qualified capacity names, or the missing name."""
    out: dict[str, Decimal] = {}
    for name, amount in requests:
        q = qualify(name, device.driver)
        if q not in device.capacity:
            return name
        out[q] = amount
    return out


def demand(requests: tuple[tuple[str, Decimal], ...], device: Device) -> Fit:
    """What one allocation of this request consumes on `device`, ignoring what is in use."""
    resolved = resolve_requests(requests, device)
    if isinstance(resolved, str):
        return Fit({}, f"the device has no capacity {resolved!r}", resolved)
    consumed: dict[str, Decimal] = {}
    for q, cap in device.capacity.items():
        requested = resolved.get(q)
        amount = consumed_amount(requested, cap)
        why = violates(amount, cap.policy)
        if why is not None:
            return Fit({}, f"{cap.name} {_show(requested, amount)} is {why}", cap.name)
        if amount > cap.value:
            return Fit(
                {}, f"{cap.name} {_show(requested, amount)} is more than the device has", cap.name
            )
        consumed[q] = amount
    return Fit(consumed)


def _show(requested: Decimal | None, amount: Decimal) -> str:
    if requested is None:
        return f"(default {format_quantity(amount)})"
    if requested == amount:
        return format_quantity(amount)
    return f"{format_quantity(requested)} (rounded up to {format_quantity(amount)})"

"""Kubernetes quantities from the API (a claim's consumedCapacity, VgpuConfig fields).

Values the API server hands us follow Kubernetes' rules, not the shim's: `k`, `M`, `G` are
powers of 1000, `Ki`, `Mi`, `Gi` powers of 1024, `m` is milli and `1e9` an exponent. They are
parsed with the kubernetes client's own parser so both sides agree on every spelling; the
HAMi-style lower-case suffixes of the shim's environment and the CLI (sharing/quantity.py) are
not Kubernetes quantities and are refused here.
"""

from __future__ import annotations

from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity

FORMS = "a Kubernetes quantity (e.g. 4Gi, 512Mi, 4G, 1500k, 1e9)"
LIMIT = Decimal(2**64)  # bytes, percent: nothing a claim can hold comes near


class KubeQuantityError(ValueError):
    """Not a valid quantity for the field. str() is one line naming the field, value and forms."""


def parse(text: str | int, what: str) -> Decimal:
    """Any Kubernetes quantity as an exact Decimal; KubeQuantityError when it is not one."""
    if isinstance(text, bool) or not isinstance(text, str | int):
        raise KubeQuantityError(f"{what}: {text!r} is not a quantity; allowed: {FORMS}")
    try:
        value: Decimal = parse_quantity(text)  # type: ignore[no-untyped-call]
    except ValueError as e:
        raise KubeQuantityError(f"{what}: {text!r} is not a quantity; allowed: {FORMS}") from e
    # The client's parser takes "Infinity" and exponents of any size ("1e4000000000": turning
    # that into an int would take the process's memory): no capacity is that large.
    if not value.is_finite() or value.copy_abs() >= LIMIT:
        raise KubeQuantityError(f"{what}: {text!r} is out of range; allowed: {FORMS}, below 2^64")
    return value


def parse_bytes(text: str | int, what: str) -> int:
    """A byte count: a Kubernetes quantity that comes out as a whole number of bytes."""
    value = parse(text, what)
    if value != value.to_integral_value():
        raise KubeQuantityError(f"{what}: {text!r} is not a whole number of bytes")
    return int(value)

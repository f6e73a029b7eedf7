"""Kubernetes quantities (resource.Quantity) as exact Decimals, and back to short text.

Capacities, request amounts and policy bounds are all quantities; keeping them as Decimals
keeps "1.5Gi", "500m" and "100" exact, as the apiserver's arbitrary-precision type does.
"""

from __future__ import annotations

from decimal import Decimal
from functools import lru_cache

from kubernetes.utils.quantity import parse_quantity

_BINARY = (
    ("Ei", 1024**6),
    ("Pi", 1024**5),
    ("Ti", 1024**4),
    ("Gi", 1024**3),
    ("Mi", 1024**2),
    ("Ki", 1024),
)


_LIMIT = Decimal(2**64)


class QuantityError(ValueError):
    """Text that is not a Kubernetes quantity. str() is one line."""


def _parse(value: str | int | float) -> Decimal:
    try:
        q = parse_quantity(value)  # type: ignore[no-untyped-call]
    except ValueError:
        raise QuantityError(f"{value!r} is not a quantity (e.g. 4Gi, 100, 500m)") from None
    q = q if isinstance(q, Decimal) else Decimal(q)
    # "Infinity" and exponents of any size parse; printing "1e4000000000" as an integer would
    # take the process's memory
    if not q.is_finite() or q.copy_abs() >= _LIMIT:
        raise QuantityError(f"{value!r} is out of range (a quantity below 2^64, e.g. 4Gi)")
    return q


# Slices repeat the same few quantities thousands of times.
_parse_text = lru_cache(maxsize=4096)(_parse)


def parse(value: object) -> Decimal:
    """A quantity from YAML/JSON: a string like "4Gi" or "500m", or a plain number."""
    if isinstance(value, str):
        return _parse_text(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise QuantityError(f"{value!r} is not a quantity (e.g. 4Gi, 100, 500m)")
    return _parse(value)


@lru_cache(maxsize=4096)  # a plan prints the same few amounts thousands of times
def format_quantity(q: Decimal) -> str:
    """Short canonical text: 4294967296 -> "4Gi", 100 -> "100", 0.5 -> "500m"."""
    if q == q.to_integral_value():
        n = int(q)
        for suffix, size in _BINARY:
            if n and n % size == 0 and abs(n) >= size:
                return f"{n // size}{suffix}"
        return str(n)
    milli = q * 1000
    if milli == milli.to_integral_value():
        return f"{int(milli)}m"
    return format(q.normalize(), "f")

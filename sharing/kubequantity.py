"""Kubernetes quantities: everything that comes from Kubernetes (the admin policy ConfigMap,
a claim's consumedCapacity and VgpuConfig, ResourceSlices read by `vgpu plan`, the examples).

Kubernetes' rules, not the shim's: `k`, `M`, `G`, `T`, `P`, `E` are powers of 1000, `Ki`, `Mi`,
`Gi`, `Ti`, `Pi`, `Ei` powers of 1024, `m` is milli and `1e9` an exponent. They are parsed with the
official client's parser (`kubernetes.utils.parse_quantity`) so both sides agree on every
spelling; the HAMi-style lower-case suffixes of the shim's environment and `vgpu run`
(sharing/quantity.py) are not Kubernetes quantities (`512m` is half a byte here). Values are exact
Decimals, as the API server's arbitrary-precision type keeps them.

The client's parser is more lenient than the API server (it takes "4 Gi", "500K" and non-ASCII
digits); text is first held to the API server's grammar (apimachinery's resource.Quantity), so a
policy value that works here is one `kubectl` would take.
"""

from __future__ import annotations

import re
from decimal import Decimal
from functools import lru_cache

from kubernetes.utils.quantity import parse_quantity

FORMS = "a Kubernetes quantity (e.g. 4Gi, 512Mi, 4G, 1500k, 1e9) below 2^64"
LIMIT = Decimal(2**64)  # bytes, percent: nothing a claim or a policy holds comes near

# apimachinery's grammar: signed number, then a binary-SI, decimal-SI or exponent suffix.
_GRAMMAR = re.compile(
    r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?",
    re.ASCII,
)

_BINARY = (
    ("Ei", 1024**6),
    ("Pi", 1024**5),
    ("Ti", 1024**4),
    ("Gi", 1024**3),
    ("Mi", 1024**2),
    ("Ki", 1024),
)


class KubeQuantityError(ValueError):
    """Not a valid quantity for the field. str() is one line naming the field, value and forms."""


@lru_cache(maxsize=4096)  # slices repeat the same few quantities thousands of times
def _parse_text(text: str) -> Decimal | None:
    if not _GRAMMAR.fullmatch(text):
        return None
    try:
        value = parse_quantity(text)  # type: ignore[no-untyped-call]
    except ValueError:
        return None
    return value if isinstance(value, Decimal) else Decimal(value)


def _prefix(what: str) -> str:
    return f"{what}: " if what else ""


def parse(value: object, what: str = "") -> Decimal:
    """A quantity from the API or YAML (a string such as "4Gi" or "500m", or a plain number) as
    an exact Decimal; KubeQuantityError (prefixed with `what` when given) when it is not one."""
    q: Decimal | None = None
    if isinstance(value, str):
        q = _parse_text(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        q = _parse_text(repr(value))
    if q is None:
        raise KubeQuantityError(f"{_prefix(what)}{value!r} is not a quantity; allowed: {FORMS}")
    # The client's parser takes exponents of any size ("1e4000000000": turning that into an int
    # would take the process's memory): no capacity or size comes near 2^64.
    if not q.is_finite() or q.copy_abs() >= LIMIT:
        raise KubeQuantityError(f"{_prefix(what)}{value!r} is out of range; allowed: {FORMS}")
    return q


def parse_bytes(value: object, what: str = "") -> int:
    """A byte count: a Kubernetes quantity that comes out as a whole number of bytes, 0 or more."""
    q = parse(value, what)
    if q < 0:
        raise KubeQuantityError(f"{_prefix(what)}{value!r} is negative; allowed: 0 or more bytes")
    if q != q.to_integral_value():
        raise KubeQuantityError(
            f"{_prefix(what)}{value!r} is {format(q.normalize(), 'f')} bytes, not a whole number of "
            f"bytes; allowed: {FORMS}"
        )
    return int(q)


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


def to_kubernetes(n: int) -> str:
    """The shortest exact Kubernetes quantity for a byte count (e.g. 4294967296 -> '4Gi')."""
    return format_quantity(Decimal(n))

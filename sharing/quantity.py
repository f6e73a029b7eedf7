"""Memory quantities as people write them in the shim's environment and on the `vgpu` CLI.

Accepted forms (the shim's C parser accepts exactly the same set; both rules' cases are one table:
tests/support/quantity_cases.py):
  plain bytes          "1073741824"
  binary suffixes      "512Ki", "4Mi", "4Gi", "1Ti", "1Pi"   (powers of 1024)
  decimal suffixes     "500K", "4M", "4G", "1T", "1P"        (upper case: powers of 1000)
  field suffixes       "64k", "512m", "4g", "1t"             (lower case: HAMi-core, powers of 1024)
Lower-case "m" is mebibytes here, as HAMi-core has it (never Kubernetes' milli). Fractions are
allowed with a suffix ("1.5Gi") and must come out as whole bytes.

Values that come from Kubernetes (the policy, claims) are Kubernetes quantities ("1500k" is
1500000 bytes there) and are parsed with Kubernetes' rules (sharing/kubequantity.py), not here.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

ACCEPTED_FORMS = (
    "bytes (e.g. 1073741824), or a number with Ki/Mi/Gi/Ti/Pi (1024), K/M/G/T/P (1000) "
    "or k/m/g/t (1024) suffix (e.g. 4Gi, 512m)"
)

_MULTIPLIERS: dict[str, int] = {
    "": 1,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "P": 1000**5,
    # The field's lower-case suffixes are binary (HAMi-core's CUDA_DEVICE_MEMORY_LIMIT).
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
}

_PATTERN = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|K|M|G|T|P|k|m|g|t)?$")


class QuantityError(ValueError):
    """A quantity that is not a valid memory size. str() is one line naming value and forms."""


def parse_bytes(text: str, what: str = "quantity") -> int:
    """Parse a memory quantity into bytes; raise QuantityError with a one-line message."""
    s = text.strip()
    m = _PATTERN.match(s)
    if not m:
        raise QuantityError(f"{what}: {text!r} is not a memory size; accepted: {ACCEPTED_FORMS}")
    number, suffix = m.group(1), m.group(2) or ""
    try:
        value = Decimal(number) * _MULTIPLIERS[suffix]
    except InvalidOperation as e:  # pragma: no cover - the regex admits only valid decimals
        raise QuantityError(f"{what}: {text!r} is not a number") from e
    if value != value.to_integral_value():
        raise QuantityError(f"{what}: {text!r} is not a whole number of bytes")
    return int(value)


def format_bytes(n: int) -> str:
    """Human form used in messages: '4.00 GiB', '64.0 MiB', '512 B' (same as the shim's)."""
    if n < 1024:
        return f"{n} B"
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            v = n / size
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}"
    raise AssertionError("unreachable")

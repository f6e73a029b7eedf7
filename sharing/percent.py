"""Compute (SM) caps as the shim reads them (CUDA_DEVICE_SM_LIMIT[_i], the limits file, `vgpu
run --compute`): one rule for every side, the same as shim/src/enforced.c's parse_percent.

Accepted: `[0-9]+(.[0-9]+)?` with an optional `%` and surrounding blanks, from 0 to 100.
`0` and `100` mean "no cap" (0 as HAMi-core spells it); anything above 100, a sign, hex or an
exponent is refused, so a typo can never turn the cap off. A cap is kept in permille, at least
1 (0.01% still caps) and at most 999.
"""

from __future__ import annotations

import math
import re

FORMS = "a percentage 0-100 (e.g. 30 or 12.5; 0 or 100 = no cap)"
NO_CAP = 0  # permille value of "no cap"

_PATTERN = re.compile(r"[ \t]*([0-9]+(?:\.[0-9]+)?)%?[ \t]*")
_MAX_DIGITS = 32  # the shim's buffer


class PercentError(ValueError):
    """Not a compute cap. str() is one line naming the value and the accepted forms."""


def parse_permille(text: str, what: str = "compute cap") -> int:
    """The cap in permille (NO_CAP for 0 or 100); PercentError for anything else."""
    m = _PATTERN.fullmatch(text)
    if not m or len(m.group(1)) > _MAX_DIGITS or float(m.group(1)) > 100:
        raise PercentError(f"{what}: {text!r} is not a percentage; accepted: {FORMS}")
    d = float(m.group(1))
    if d in (0.0, 100.0):
        return NO_CAP
    x = d * 10.0  # as the shim: lround(d * 10.0) in double precision
    pm = math.floor(x)
    if x - pm >= 0.5:
        pm += 1
    return min(max(pm, 1), 999)


def format_permille(permille: int) -> str:
    """A cap in permille as the percentage parse_permille reads back: 300 -> '30', 125 -> '12.5'."""
    whole, tenth = divmod(permille, 10)
    return f"{whole}.{tenth}" if tenth else str(whole)

"""The one table of compute-cap cases every reader of a cap must agree on: the shim's
environment (shim/src/enforced.c), the limits file (sharing/limitsfile.py), `vgpu run --compute`
(sharing/cli/compute_run.py), all through sharing/percent.py on the Python side.
Value -> permille (0 = no cap) or None = refused."""

from __future__ import annotations

CASES: list[tuple[str, int | None]] = [
    ("30", 300),
    ("12.5", 125),
    ("30%", 300),
    (" 20 ", 200),
    ("1", 10),
    ("0.01", 1),  # still capped, never "no cap"
    ("99.9", 999),
    ("99.96", 999),
    ("007", 70),
    # the documented spellings of "no cap"
    ("0", 0),
    ("0.0", 0),
    ("100", 0),
    ("100%", 0),
    ("100.0", 0),
    # refused: a value that would silently remove or garble the cap
    ("", None),
    ("   ", None),
    ("101", None),
    ("100.5", None),
    ("1000", None),
    ("-5", None),
    ("+30", None),
    ("0x10", None),
    ("1e1", None),
    ("nan", None),
    ("inf", None),
    ("abc", None),
    ("30x", None),
    ("30 %", None),
    ("30%%", None),
    (".5", None),
    ("5.", None),
    ("1,5", None),
]

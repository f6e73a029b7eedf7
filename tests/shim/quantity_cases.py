"""The one table of memory-quantity cases both parsers (sharing/quantity.py and the shim's C
parser, shim/src/config.c) must agree on. None = rejected."""

from __future__ import annotations

CASES: list[tuple[str, int | None]] = [
    ("0", 0),
    ("1073741824", 1073741824),
    ("007", 7),
    ("  4Gi ", 4 * 1024**3),
    ("\t512Mi\n", 512 * 1024**2),
    ("512Ki", 512 * 1024),
    ("1Ti", 1024**4),
    ("1Pi", 1024**5),
    ("500K", 500_000),
    ("4M", 4_000_000),
    ("4G", 4_000_000_000),
    ("1T", 10**12),
    ("2P", 2 * 10**15),
    # the field's lower-case suffixes are binary (HAMi-core)
    ("64k", 64 * 1024),
    ("512m", 512 * 1024**2),
    ("4g", 4 * 1024**3),
    ("1t", 1024**4),
    ("1.5Gi", 1536 * 1024**2),
    ("0.5Ki", 512),
    ("1.25k", 1280),
    ("2.000G", 2 * 10**9),
    ("18446744073709551615", 2**64 - 1),
    # rejected
    ("", None),
    ("   ", None),
    ("-1", None),
    ("-4Gi", None),
    ("+4Gi", None),
    ("4 Gi", None),
    ("4GB", None),
    ("4gi", None),
    ("4GiB", None),
    ("4Ei", None),
    ("1e9", None),
    ("0x10", None),
    (".5Gi", None),
    ("5.", None),
    ("1.5", None),  # not a whole number of bytes
    ("0.3k", None),  # 307.2 bytes
    ("Gi", None),
    ("4Gi4", None),
    ("1,000", None),
    ("\u0664", None),  # a non-ASCII digit
]

# Beyond 64 bits: the C parser refuses (its counters are 64-bit); sharing.quantity accepts
# arbitrary sizes and `vgpu run` refuses them itself.
C_ONLY_REJECTED = [
    "18446744073709551616",
    "16Pi" + "0" * 3,
    "99999999999999999999999999999999999999999",
]

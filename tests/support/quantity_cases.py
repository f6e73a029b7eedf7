"""The one table of memory-quantity cases for the two rules (docs/policy.md, docs/shim.md):

  HAMi: the shim's environment and `vgpu run` (sharing/quantity.py and its C twin in
        shim/src/config.c, which must agree on every case);
  KUBE: everything that comes from Kubernetes (sharing/kubequantity.py: the policy, claims).

Each row is (text, bytes under HAMi's rules, bytes under Kubernetes' rules); None = refused.
"""

from __future__ import annotations

GiB = 1024**3

CASES: list[tuple[str, int | None, int | None]] = [
    ("0", 0, 0),
    ("1073741824", GiB, GiB),
    ("007", 7, 7),
    ("  4Gi ", 4 * GiB, None),  # Kubernetes takes no blanks
    ("\t512Mi\n", 512 * 1024**2, None),
    ("512Ki", 512 * 1024, 512 * 1024),
    ("1Ti", 1024**4, 1024**4),
    ("1Pi", 1024**5, 1024**5),
    ("500K", 500_000, None),  # Kubernetes' kilo is lower-case k
    ("4M", 4_000_000, 4_000_000),
    ("4G", 4_000_000_000, 4_000_000_000),
    ("1T", 10**12, 10**12),
    ("2P", 2 * 10**15, 2 * 10**15),
    # lower case: HAMi-core's binary suffixes; Kubernetes' k is 1000 and m is milli
    ("64k", 64 * 1024, 64_000),
    ("1500k", 1500 * 1024, 1_500_000),
    ("512m", 512 * 1024**2, None),  # half a byte in Kubernetes
    ("4000m", 4000 * 1024**2, 4),
    ("4g", 4 * GiB, None),
    ("1t", 1024**4, None),
    ("1.5Gi", 1536 * 1024**2, 1536 * 1024**2),
    ("0.5Ki", 512, 512),
    ("1.25k", 1280, 1250),
    ("2.000G", 2 * 10**9, 2 * 10**9),
    ("18446744073709551615", 2**64 - 1, 2**64 - 1),
    ("1e9", None, 10**9),  # an exponent: Kubernetes only
    ("4E3", None, 4000),
    ("1E", None, 10**18),
    ("4Ei", None, 4 * 1024**6),
    (".5Gi", None, 512 * 1024**2),
    ("5.", None, 5),
    ("+4Gi", None, 4 * GiB),
    ("0.3k", None, 300),  # 307.2 bytes under HAMi's rules
    # refused by both
    ("", None, None),
    ("   ", None, None),
    ("-1", None, None),
    ("-4Gi", None, None),
    ("4 Gi", None, None),
    ("4GB", None, None),
    ("4gi", None, None),
    ("4GiB", None, None),
    ("0x10", None, None),
    ("1.5", None, None),  # not a whole number of bytes
    ("0.5", None, None),
    ("1500u", None, None),
    ("Gi", None, None),
    ("4Gi4", None, None),
    ("1,000", None, None),
    ("abc", None, None),
    ("4Gi!", None, None),
    ("\u0664", None, None),  # a non-ASCII digit
]

HAMI: list[tuple[str, int | None]] = [(t, h) for t, h, _ in CASES]
KUBE: list[tuple[str, int | None]] = [(t, k) for t, _, k in CASES]

# Beyond 64 bits: the C parser refuses (its counters are 64-bit); sharing.quantity accepts
# arbitrary sizes and `vgpu run` refuses them itself.
C_ONLY_REJECTED = [
    "18446744073709551616",
    "16Pi" + "0" * 3,
    "99999999999999999999999999999999999999999",
]

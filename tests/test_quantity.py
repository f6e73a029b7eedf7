"""Memory quantities: the forms users write, and one-line errors for everything else."""

from __future__ import annotations

import pytest

from sharing.quantity import QuantityError, format_bytes, parse_bytes, to_kubernetes

GOOD = [
    ("0", 0),
    ("1073741824", 1 << 30),
    ("4Gi", 4 << 30),
    ("512Mi", 512 << 20),
    ("64Ki", 64 << 10),
    ("1Ti", 1 << 40),
    ("1.5Gi", 3 << 29),
    ("4G", 4_000_000_000),
    ("500k", 500 * 1024),
    ("500K", 500_000),
    ("512m", 512 << 20),
    ("4g", 4 << 30),
    (" 8Gi ", 8 << 30),
]

BAD = ["", "-1", "-4Gi", "4GB", "4 Gi", "Gi", "1.5", "0.3Ki", "4gi", "abc", "1e9", "4Gi!", "0x10"]


@pytest.mark.parametrize(("text", "expected"), GOOD)
def test_accepted_forms(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", BAD)
def test_rejected_with_one_line_naming_value_and_forms(text: str) -> None:
    with pytest.raises(QuantityError) as e:
        parse_bytes(text, "--memory")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("--memory: ")
    assert repr(text) in msg


def test_format_and_kubernetes_forms() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(64 << 20) == "64.0 MiB"
    assert format_bytes(4 << 30) == "4.00 GiB"
    assert format_bytes(4_262_000_000) == "3.97 GiB"
    assert to_kubernetes(4 << 30) == "4Gi"
    assert to_kubernetes(3 << 29) == "1536Mi"
    assert to_kubernetes(1000) == "1000"

"""Memory quantities, both rules from one table (tests/support/quantity_cases.py): HAMi's for the
shim's environment and `vgpu run` (sharing/quantity.py), Kubernetes' for everything that comes
from Kubernetes (sharing/kubequantity.py). Every refusal is one line naming the value."""

from __future__ import annotations

from decimal import Decimal

import pytest

from sharing import kubequantity
from sharing.quantity import QuantityError, format_bytes, parse_bytes
from tests.support.quantity_cases import HAMI, KUBE


@pytest.mark.parametrize(("text", "expected"), HAMI)
def test_hami_rules(text: str, expected: int | None) -> None:
    if expected is not None:
        assert parse_bytes(text) == expected
        return
    with pytest.raises(QuantityError) as e:
        parse_bytes(text, "--memory")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("--memory: ")
    assert repr(text) in msg


@pytest.mark.parametrize(("text", "expected"), KUBE)
def test_kubernetes_rules(text: str, expected: int | None) -> None:
    if expected is not None:
        assert kubequantity.parse_bytes(text, "memory") == expected
        return
    with pytest.raises(kubequantity.KubeQuantityError) as e:
        kubequantity.parse_bytes(text, "default.memory.min")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"default.memory.min: {text!r} is ")
    assert "allowed:" in msg


def test_kubernetes_fractions_name_the_bytes() -> None:
    with pytest.raises(
        kubequantity.KubeQuantityError, match=r"'512m' is 0\.512 bytes, not a whole"
    ):
        kubequantity.parse_bytes("512m", "reservedMemory")
    assert kubequantity.parse("500m") == Decimal("0.5")  # cores and other fractional amounts


def test_kubernetes_numbers_from_yaml() -> None:
    assert kubequantity.parse_bytes(4096, "x") == 4096
    assert kubequantity.parse(1.5) == Decimal("1.5")
    for bad in (True, None, [1], {"a": 1}):
        with pytest.raises(kubequantity.KubeQuantityError, match="is not a quantity"):
            kubequantity.parse(bad, "x")


def test_format_and_kubernetes_forms() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(64 << 20) == "64.0 MiB"
    assert format_bytes(4 << 30) == "4.00 GiB"
    assert format_bytes(4_262_000_000) == "3.97 GiB"
    assert kubequantity.to_kubernetes(4 << 30) == "4Gi"
    assert kubequantity.to_kubernetes(3 << 29) == "1536Mi"
    assert kubequantity.to_kubernetes(1000) == "1000"
    assert kubequantity.format_quantity(Decimal("0.5")) == "500m"
    # what is published reads back as the same number
    for n in (0, 1, 1000, 3 << 29, 80 * 10**9, 2**64 - 1):
        assert kubequantity.parse_bytes(kubequantity.to_kubernetes(n)) == n

"""Quantities no capacity can have are refused in one line, before any arithmetic: the
kubernetes client's parser accepts "Infinity" and exponents of any size, and an integer made of
"1e4000000000" would take the process's memory and time."""

from __future__ import annotations

import pytest

from sharing.kubequantity import KubeQuantityError as QuantityError
from sharing.kubequantity import parse


@pytest.mark.parametrize("text", ["Infinity", "-Infinity", "NaN", "1e400", "1e4000000000",
                                  "18446744073709551616"])  # fmt: skip
def test_out_of_range_quantities_are_one_line(text: str) -> None:
    with pytest.raises(QuantityError) as e:
        parse(text)
    assert str(e.value).startswith(f"{text!r} is ")
    assert "\n" not in str(e.value) and "below 2^64" in str(e.value)


def test_the_largest_quantity_still_parses() -> None:
    assert parse("18446744073709551615") == 2**64 - 1

"""Exponential backoff for the plugin's retries (publishing ResourceSlices, re-registering with
the kubelet): the delays before each attempt, growing by `factor` up to `maximum`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial: float = 0.5
    factor: float = 2.0
    maximum: float = 30.0

    def delays(self) -> Iterator[float]:
        """initial, initial*factor, ... capped at maximum, forever; start again with a new call."""
        d = self.initial
        while True:
            yield d
            d = min(self.maximum, d * self.factor)

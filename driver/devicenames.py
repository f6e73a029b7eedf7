"""The names this driver's devices are published under, and reading them back from a claim.

  sharing mode    `gpu-<index>`            one device per GPU, shared by consumable capacity
  partition mode  `gpu-<index>-slice-<k>`  N fixed devices per GPU, k in 0..N-1

The publishing side (driver/slicebuild.py, the plugin's first health report) and the prepare
side (driver/claims.py) both use this module (device names, publishing modes, capacity names), so
a name one writes is a name the other reads.
The partition arithmetic (memory and cores of a slice) is the policy's: sharing.policy.Rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

# The publishing modes: consumable capacity, or fixed partitions where the API server drops it.
Mode = Literal["sharing", "partition"]
SHARING: Mode = "sharing"
PARTITION: Mode = "partition"
MODES: tuple[Mode, ...] = get_args(Mode)

# The capacities a sharing-mode device publishes and a claim's allocation consumes.
MEMORY_CAPACITY = "memory"  # bytes
CORES_CAPACITY = "cores"  # percent of the GPU's SMs (sharing.policy.CORES_TOTAL in all)
SHARERS_CAPACITY = "sharers"  # allocations on one GPU; each consumes exactly 1

SHARING_FORM = "gpu-<index>"
PARTITION_FORM = "gpu-<index>-slice-<k>"
_SHARING = re.compile(r"gpu-(0|[1-9][0-9]*)")
_PARTITION = re.compile(r"gpu-(0|[1-9][0-9]*)-slice-(0|[1-9][0-9]*)")


@dataclass(frozen=True)
class DeviceName:
    gpu_index: int
    partition: int | None  # None in sharing mode


def sharing_name(index: int) -> str:
    return f"gpu-{index}"


def partition_name(index: int, k: int) -> str:
    return f"gpu-{index}-slice-{k}"


def as_mode(text: str) -> Mode | None:
    """`text` as a publishing mode, None when it is not one."""
    for m in MODES:
        if text == m:
            return m
    return None


def names(index: int, mode: str, partitions: int) -> list[str]:
    """The device names of GPU `index` in `mode`."""
    if mode == PARTITION:
        return [partition_name(index, k) for k in range(partitions)]
    return [sharing_name(index)]


def parse(name: str, mode: str) -> DeviceName | None:
    """The GPU (and partition) a device name of `mode` stands for; None if it is not one."""
    if mode == PARTITION:
        m = _PARTITION.fullmatch(name)
        return DeviceName(int(m.group(1)), int(m.group(2))) if m else None
    m = _SHARING.fullmatch(name)
    return DeviceName(int(m.group(1)), None) if m else None

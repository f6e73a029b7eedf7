"""The domain model of `vgpu plan`: devices from ResourceSlices, device classes, claim specs.

Names follow resource.k8s.io/v1. Attribute and capacity names are kept fully qualified
("<domain>/<name>"; an unqualified name belongs to the device's driver), as the allocator
resolves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Literal

AttrKind = Literal["int", "bool", "string", "version"]
AttrValue = tuple[AttrKind, int | bool | str]


def qualify(name: str, driver: str) -> str:
    """'memory' -> '<driver>/memory'; a name with a domain stays as it is."""
    return name if "/" in name else f"{driver}/{name}"


@dataclass(frozen=True)
class ValidRange:
    min: Decimal
    max: Decimal | None
    step: Decimal | None


@dataclass(frozen=True)
class RequestPolicy:
    default: Decimal | None
    valid_values: tuple[Decimal, ...] | None  # ascending
    valid_range: ValidRange | None


@dataclass(frozen=True)
class Capacity:
    name: str  # as published (for the output and the allocation result)
    value: Decimal
    policy: RequestPolicy | None


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str  # NoSchedule, NoExecute (both keep new allocations off), None, ...


@dataclass(frozen=True)
class Toleration:
    key: str
    operator: Literal["Equal", "Exists"]
    value: str
    effect: str  # "" tolerates every effect

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return not self.key or self.key == taint.key
        return self.key == taint.key and self.value == taint.value


@dataclass
class Device:
    """One device of a ResourceSlice, on one node. `index` is its place in the node's order."""

    node: str
    driver: str
    pool: str
    name: str
    attributes: dict[str, AttrValue]  # qualified name -> value
    capacity: dict[str, Capacity]  # qualified name -> capacity
    allow_multiple: bool
    index: int = 0
    taints: tuple[Taint, ...] = ()

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)

    def attribute(self, qualified: str) -> AttrValue | None:
        return self.attributes.get(qualified)


@dataclass(frozen=True)
class DeviceClass:
    name: str
    selectors: tuple[str, ...]
    file: str = ""  # where it was read, for error messages
    path: str = ""  # field path of its selectors there


@dataclass(frozen=True)
class DeviceRequest:
    """An `exactly` request or one `firstAvailable` subrequest."""

    name: str  # "req" or "req/sub"
    device_class: str
    selectors: tuple[str, ...]
    mode: Literal["ExactCount", "All"]
    count: int
    capacity: tuple[tuple[str, Decimal], ...]  # requested amounts, names as written
    tolerations: tuple[Toleration, ...] = ()


@dataclass(frozen=True)
class Request:
    name: str
    alternatives: tuple[DeviceRequest, ...]  # one for `exactly`, several for `firstAvailable`


@dataclass(frozen=True)
class Constraint:
    requests: tuple[str, ...]  # empty: all requests
    match_attribute: str | None
    distinct_attribute: str | None


@dataclass(frozen=True)
class BurstLimit:
    """A VgpuConfig `memoryLimit` of the claim's config (docs/policy.md, bursting): bytes, or a
    ratio of the request."""

    text: str
    nbytes: int | None = None
    ratio: Decimal | None = None

    def of(self, request: Decimal) -> Decimal:
        return Decimal(self.nbytes) if self.nbytes is not None else request * (self.ratio or 1)


@dataclass(frozen=True)
class ClaimSpec:
    requests: tuple[Request, ...]
    constraints: tuple[Constraint, ...]
    # request name ("" for every request) -> its burst limit; planning counts requests only
    burst: tuple[tuple[str, BurstLimit], ...] = ()

    def burst_limit(self, request: str) -> BurstLimit | None:
        """The limit of a request ("req" or "req/sub"), the last config naming it winning."""
        found = None
        for name, limit in self.burst:
            if name in ("", request, request.split("/")[0]):
                found = limit
        return found


@dataclass(frozen=True)
class Workload:
    name: str
    replicas: int
    spec: ClaimSpec


@dataclass(frozen=True)
class Allocated:
    """One device of an existing ResourceClaim's allocation (status.allocation.devices)."""

    claim: str  # namespace/name, for messages
    driver: str
    pool: str
    device: str
    consumed: dict[str, Decimal] | None  # consumedCapacity by name; None: taken whole


@dataclass
class Inventory:
    """Every usable device, grouped by node in planning order, plus what was left out, and
    the allocations of existing claims to start from."""

    nodes: dict[str, list[Device]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    allocated: list[Allocated] = field(default_factory=list)

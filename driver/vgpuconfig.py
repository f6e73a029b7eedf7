"""Strict decoding of the driver's opaque configuration, `vgpu.sharing.dev/v1alpha1 VgpuConfig`.

A DeviceClass or ResourceClaim carries it in `config[].opaque.parameters` for our driver:

    apiVersion: vgpu.sharing.dev/v1alpha1
    kind: VgpuConfig
    computePolicy: hard        # hard | elastic | off            (default hard)
    priority: 1                # integer -100..100, lower is served first (default 1)
    memoryLimitOverride: 2Gi   # a Kubernetes quantity; lowers the slice's memory limit, never above the allocation
    exclusive: true            # a whole GPU (set by the vgpu-whole.sharing.dev DeviceClass)
    memoryLimit: 2x            # burst limit: a quantity, or <r>x for r times the request
    showMemoryLimit: false     # the slice sees its limit, not its request, as the total

memoryLimit / showMemoryLimit: bursting (docs/policy.md, "Memory that bursts and is given back"):
the slice may use memory above its request, up to this limit, out of what no claim was
allocated, and the plugin takes it back when a new claim needs it. Bounded by the admin's
`burst` policy (driver/claims.py), which allows none by default.

computePolicy: `hard` caps the slice's SM share at its limit always; `elastic` lets it use idle
SMs beyond the limit while nobody else wants them; `off` disables compute throttling (memory is
still enforced). priority follows CUDA's and HAMi's convention, which the shim implements
(docs/compute.md): lower is higher priority, 0 = high, 1 = normal; it decides which elastic
slices get idle SMs first. The values reach the shim as VGPU_COMPUTE_POLICY and VGPU_PRIORITY.
A claim's own config (`source: FromClaim`) may only choose what the admin's sharing policy
allows (allowedComputePolicies, highestPriority: driver/claims.py, docs/policy.md); a
DeviceClass's config is the admin's and may choose anything.

Decoding is strict because a typo silently ignored would run a workload with limits the user
did not ask for: unknown fields and bad values raise ConfigError naming the field.

exclusive: the claim gets the whole GPU (its whole memory, no SM cap). In sharing mode it must
also hold all the GPU's `cores` (request `cores: "100"`), which is what keeps other claims off
the GPU; prepare refuses it otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sharing import kubequantity
from sharing.limitsfile import POLICIES

API_VERSION = "vgpu.sharing.dev/v1alpha1"
KIND = "VgpuConfig"
COMPUTE_POLICIES = POLICIES
PRIORITY_MIN, PRIORITY_MAX = -100, 100
PRIORITY_DEFAULT = 1  # the shim's default: normal
_FIELDS = (
    "apiVersion",
    "kind",
    "computePolicy",
    "priority",
    "memoryLimitOverride",
    "exclusive",
    "memoryLimit",
    "showMemoryLimit",
)
_RATIO_RE = re.compile(r"([0-9]{1,6}(?:\.[0-9]{1,6})?)x")


@dataclass(frozen=True)
class MemoryLimit:
    """A burst limit as a config gives it: bytes, or a ratio of the request."""

    text: str  # as written, for messages
    nbytes: int | None = None
    ratio: float | None = None

    def of(self, request: int) -> int:
        """The limit in bytes on a device where the request is `request`."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.ratio is not None
        return int(request * self.ratio)


class ConfigError(ValueError):
    """An opaque config that is not a valid VgpuConfig. str() is one line naming the field."""


@dataclass(frozen=True)
class VgpuConfig:
    """One decoded config; None means "not set here" so that a later config only overrides
    the fields it names."""

    compute_policy: str | None = None
    priority: int | None = None
    memory_limit_override: int | None = None  # bytes
    exclusive: bool | None = None
    memory_limit: MemoryLimit | None = None
    show_memory_limit: bool | None = None

    def merged(self, later: VgpuConfig) -> VgpuConfig:
        """This config with every field `later` sets taking precedence."""
        return VgpuConfig(
            compute_policy=later.compute_policy or self.compute_policy,
            priority=later.priority if later.priority is not None else self.priority,
            memory_limit_override=(
                later.memory_limit_override
                if later.memory_limit_override is not None
                else self.memory_limit_override
            ),
            exclusive=later.exclusive if later.exclusive is not None else self.exclusive,
            memory_limit=(
                later.memory_limit if later.memory_limit is not None else self.memory_limit
            ),
            show_memory_limit=(
                later.show_memory_limit
                if later.show_memory_limit is not None
                else self.show_memory_limit
            ),
        )


@dataclass(frozen=True)
class EffectiveConfig:
    """A config with defaults filled in: what a slice actually runs with."""

    compute_policy: str = "hard"
    priority: int = PRIORITY_DEFAULT
    memory_limit_override: int | None = None
    exclusive: bool = False
    memory_limit: MemoryLimit | None = None
    show_memory_limit: bool = False

    @staticmethod
    def of(configs: Iterable[VgpuConfig]) -> EffectiveConfig:
        """Merge configs in order (later wins) and fill in the defaults."""
        acc = VgpuConfig()
        for c in configs:
            acc = acc.merged(c)
        return EffectiveConfig(
            compute_policy=acc.compute_policy or "hard",
            priority=acc.priority if acc.priority is not None else PRIORITY_DEFAULT,
            memory_limit_override=acc.memory_limit_override,
            exclusive=bool(acc.exclusive),
            memory_limit=acc.memory_limit,
            show_memory_limit=bool(acc.show_memory_limit),
        )


def decode(parameters: Any) -> VgpuConfig:
    """Decode `opaque.parameters` (already parsed JSON) into a VgpuConfig or raise ConfigError."""
    if not isinstance(parameters, dict):
        raise ConfigError(
            f"VgpuConfig: parameters must be an object, got {type(parameters).__name__}"
        )
    for key in parameters:
        if key not in _FIELDS:
            raise ConfigError(f"VgpuConfig: unknown field {key!r}; allowed: {', '.join(_FIELDS)}")
    api_version = parameters.get("apiVersion")
    if api_version != API_VERSION:
        raise ConfigError(
            f"VgpuConfig: apiVersion {api_version!r} unsupported; allowed: {API_VERSION}"
        )
    kind = parameters.get("kind")
    if kind != KIND:
        raise ConfigError(f"VgpuConfig: kind {kind!r} unsupported; allowed: {KIND}")

    policy = parameters.get("computePolicy")
    if policy is not None and policy not in COMPUTE_POLICIES:
        raise ConfigError(
            f"VgpuConfig: computePolicy {policy!r} invalid; allowed: {', '.join(COMPUTE_POLICIES)}"
        )

    priority = parameters.get("priority")
    # bool is an int in Python; `true` is not a priority.
    if priority is not None and (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_MIN <= priority <= PRIORITY_MAX
    ):
        raise ConfigError(
            f"VgpuConfig: priority {priority!r} invalid; allowed: an integer "
            f"{PRIORITY_MIN}..{PRIORITY_MAX} (lower is served first)"
        )

    raw_mem = parameters.get("memoryLimitOverride")
    memory: int | None = None
    if raw_mem is not None:
        if isinstance(raw_mem, bool) or not isinstance(raw_mem, str | int):
            raise ConfigError(
                f"VgpuConfig: memoryLimitOverride {raw_mem!r} invalid; allowed: {kubequantity.FORMS}"
            )
        try:
            memory = kubequantity.parse_bytes(raw_mem, "VgpuConfig: memoryLimitOverride")
        except kubequantity.KubeQuantityError as e:
            raise ConfigError(str(e)) from e
        if memory <= 0:
            raise ConfigError("VgpuConfig: memoryLimitOverride must be more than 0 bytes")

    exclusive = parameters.get("exclusive")
    if exclusive is not None and not isinstance(exclusive, bool):
        raise ConfigError(f"VgpuConfig: exclusive {exclusive!r} invalid; allowed: true, false")

    show = parameters.get("showMemoryLimit")
    if show is not None and not isinstance(show, bool):
        raise ConfigError(f"VgpuConfig: showMemoryLimit {show!r} invalid; allowed: true, false")

    return VgpuConfig(
        compute_policy=policy,
        priority=priority,
        memory_limit_override=memory,
        exclusive=exclusive,
        memory_limit=_memory_limit(parameters.get("memoryLimit")),
        show_memory_limit=show,
    )


def _memory_limit(raw: Any) -> MemoryLimit | None:
    if raw is None:
        return None
    allowed = f"{kubequantity.FORMS}, or <r>x for r times the request (such as 2x, 1.5x)"
    if isinstance(raw, bool) or not isinstance(raw, str | int):
        raise ConfigError(f"VgpuConfig: memoryLimit {raw!r} invalid; allowed: {allowed}")
    if isinstance(raw, str) and (m := _RATIO_RE.fullmatch(raw.strip())):
        ratio = float(m.group(1))
        if ratio < 1:
            raise ConfigError(
                f"VgpuConfig: memoryLimit {raw!r} is below the request; allowed: 1x or more"
            )
        return MemoryLimit(text=raw, ratio=ratio)
    try:
        n = kubequantity.parse_bytes(raw, "VgpuConfig: memoryLimit")
    except kubequantity.KubeQuantityError as e:
        reason = str(e).split("; allowed:")[0]
        raise ConfigError(f"{reason}; allowed: {allowed}") from e
    if n <= 0:
        raise ConfigError("VgpuConfig: memoryLimit must be more than 0 bytes")
    return MemoryLimit(text=str(raw), nbytes=n)

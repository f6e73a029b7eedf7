"""Strict decoding of the driver's opaque configuration, `vgpu.sharing.dev/v1alpha1 VgpuConfig`.

A DeviceClass or ResourceClaim carries it in `config[].opaque.parameters` for our driver:

    apiVersion: vgpu.sharing.dev/v1alpha1
    kind: VgpuConfig
    computePolicy: hard        # hard | elastic | off            (default hard)
    priority: 1                # integer -100..100, lower is served first (default 1)
    memoryLimitOverride: 2Gi   # a Kubernetes quantity; lowers the slice's memory limit, never above the allocation
    exclusive: true            # a whole GPU (set by the vgpu-whole.sharing.dev DeviceClass)

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
_FIELDS = ("apiVersion", "kind", "computePolicy", "priority", "memoryLimitOverride", "exclusive")


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
        )


@dataclass(frozen=True)
class EffectiveConfig:
    """A config with defaults filled in: what a slice actually runs with."""

    compute_policy: str = "hard"
    priority: int = PRIORITY_DEFAULT
    memory_limit_override: int | None = None
    exclusive: bool = False

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

    return VgpuConfig(
        compute_policy=policy,
        priority=priority,
        memory_limit_override=memory,
        exclusive=exclusive,
    )

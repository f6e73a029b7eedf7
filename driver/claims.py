"""Reading a ResourceClaim and turning our driver's allocation results into per-GPU limits.

The claim is read as raw JSON (`_preload_content=False`): the kubelet-side logic needs only a
few fields, and raw JSON keeps unknown/new fields from breaking deserialisation.

Device names (driver/devicenames.py, published by driver/slicebuild.py):
  sharing mode    `gpu-<index>`              limits = the result's `consumedCapacity`
                                             (memory, cores), or the whole GPU when the
                                             allocation carries none (DRAConsumableCapacity off)
  partition mode  `gpu-<index>-slice-<k>`    limits = memory_total / N and 100 / N cores
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kubernetes import client as k8s

from driver import devicenames
from driver.devicenames import CORES_CAPACITY, MEMORY_CAPACITY
from driver.vgpuconfig import PRIORITY_MAX, ConfigError, EffectiveConfig, VgpuConfig, decode
from sharing import kubequantity
from sharing.gpus import GpuInfo
from sharing.limitsfile import POLICIES
from sharing.policy import BUILTIN, Rules
from sharing.quantity import format_bytes

RulesFor = Callable[[GpuInfo], Rules]  # the admin policy's rules of one GPU


class ClaimError(Exception):
    """A claim this node cannot prepare. str() is one line, reported in the claim's `error`."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of our driver, with the limits it grants."""

    request: str
    pool: str
    device: str
    gpu: GpuInfo
    memory_limit: int  # bytes
    sm_limit: int  # percent of the GPU's SMs, 1..100
    share_id: str | None
    config: EffectiveConfig
    burst_limit: int = (
        0  # bytes the slice may use, borrowing above memory_limit (0: = memory_limit)
    )

    @property
    def limit(self) -> int:
        return max(self.memory_limit, self.burst_limit)


@dataclass(frozen=True)
class GpuLimit:
    """The limits of one GPU as the container sees it (all results on that GPU summed)."""

    gpu: GpuInfo
    memory_limit: int
    sm_limit: int
    burst_limit: int = 0  # 0: no bursting (the limit is the request, memory_limit)

    @property
    def bursts(self) -> bool:
        return self.burst_limit > self.memory_limit


@dataclass(frozen=True)
class ClaimPlan:
    ref: ClaimRef
    devices: tuple[AllocatedDevice, ...]
    config: EffectiveConfig

    @property
    def show_limit(self) -> bool:
        """Does the slice see its limit as the total (showMemoryLimit, where it bursts)?"""
        return self.config.show_memory_limit and any(g.bursts for g in self.gpu_limits())

    def gpu_limits(self) -> list[GpuLimit]:
        """Per-GPU limits in container index order (by host GPU index)."""
        by_index: dict[int, GpuLimit] = {}
        for d in self.devices:
            prev = by_index.get(d.gpu.index)
            if prev is None:
                by_index[d.gpu.index] = GpuLimit(
                    d.gpu, d.memory_limit, d.sm_limit, d.limit if d.limit > d.memory_limit else 0
                )
            else:
                # Two slices of one GPU in one claim add up (capped at the whole GPU).
                memory = min(prev.memory_limit + d.memory_limit, d.gpu.memory_total)
                limit = min(max(prev.burst_limit, prev.memory_limit) + d.limit,
                            d.gpu.memory_total)  # fmt: skip
                by_index[d.gpu.index] = GpuLimit(
                    d.gpu, memory, min(prev.sm_limit + d.sm_limit, 100),
                    limit if limit > memory else 0,
                )  # fmt: skip
        return [by_index[i] for i in sorted(by_index)]


def read_claim(api_client: Any, ref: ClaimRef, timeout: float = 10.0) -> dict[str, Any]:
    """GET the ResourceClaim as JSON; ClaimError when it cannot be read."""
    api = k8s.ResourceV1Api(api_client)
    try:
        resp: Any = api.read_namespaced_resource_claim(
            ref.name, ref.namespace, _preload_content=False, _request_timeout=timeout
        )
    except k8s.ApiException as e:
        if e.status == 404:
            raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} not found") from e
        raise ClaimError(
            f"reading ResourceClaim {ref.namespace}/{ref.name}: HTTP {e.status} {e.reason}"
        ) from e
    except Exception as e:  # connection refused, timeout: the kubelet will retry
        raise ClaimError(f"reading ResourceClaim {ref.namespace}/{ref.name}: {e}") from e
    doc: dict[str, Any] = json.loads(resp.data)
    return doc


def _parse_cores(text: Any, where: str) -> int:
    """A cores quantity ("50", "30000m", 50) as whole percent, 1..100."""
    try:
        value = kubequantity.parse(text, f"{where}: cores")
    except kubequantity.KubeQuantityError as e:
        raise ClaimError(f"{where}: cores {text!r} is not a number of percent") from e
    if value != value.to_integral_value() or not 1 <= value <= 100:
        raise ClaimError(f"{where}: cores {text!r} invalid; allowed: a whole percent 1..100")
    return int(value)


def _node_names(node_selector: dict[str, Any]) -> set[str]:
    """Node names a nodeSelector pins the allocation to (the scheduler uses metadata.name)."""
    names: set[str] = set()
    for term in node_selector.get("nodeSelectorTerms") or []:
        for f in term.get("matchFields") or []:
            if f.get("key") == "metadata.name" and f.get("operator") == "In":
                names.update(f.get("values") or [])
        for e in term.get("matchExpressions") or []:
            if e.get("key") == "kubernetes.io/hostname" and e.get("operator") == "In":
                names.update(e.get("values") or [])
    return names


def _request_matches(result_request: str, config_requests: Sequence[str]) -> bool:
    # "gpu/small" (a firstAvailable subrequest) is matched by a config naming "gpu" too.
    if not config_requests:
        return True
    return result_request in config_requests or result_request.split("/")[0] in config_requests


def _configs_for(
    allocation: dict[str, Any], driver_name: str, request: str
) -> list[tuple[str, VgpuConfig]]:
    """Our driver's configs that apply to `request`, class configs first, then claim configs."""
    entries = (allocation.get("devices") or {}).get("config") or []
    ordered: list[tuple[str, VgpuConfig]] = []
    for source in ("FromClass", "FromClaim"):
        for i, entry in enumerate(entries):
            if entry.get("source") != source:
                continue
            opaque = entry.get("opaque") or {}
            if opaque.get("driver") != driver_name:
                continue  # another driver's config: not ours to judge
            if not _request_matches(request, entry.get("requests") or []):
                continue
            where = f"config[{i}] ({source})"
            try:
                ordered.append((where, decode(opaque.get("parameters"))))
            except ConfigError as e:
                raise ClaimError(f"{where}: {e}") from e
    return ordered


def plan_claim(
    claim: dict[str, Any],
    ref: ClaimRef,
    *,
    driver_name: str,
    node_name: str,
    gpus: Sequence[GpuInfo],
    mode: str,
    partitions: int,
    rules_for: RulesFor | None = None,
) -> ClaimPlan:
    """Check the claim is ours to prepare here and compute its limits; ClaimError if not.

    rules_for gives the admin policy's rules of a GPU (partition size, the default compute
    policy, which policies and priorities a claim's own config may choose); default: the
    built-in policy with `partitions`.
    """
    if rules_for is None:
        builtin = replace(BUILTIN, partitions=partitions)
        rules_for = lambda _gpu: builtin  # noqa: E731
    meta = claim.get("metadata") or {}
    uid = meta.get("uid")
    if uid != ref.uid:
        raise ClaimError(
            f"ResourceClaim {ref.namespace}/{ref.name} has UID {uid}, the kubelet asked for "
            f"{ref.uid} (the claim was deleted and recreated?)"
        )
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
    selector = allocation.get("nodeSelector")
    if selector:
        nodes = _node_names(selector)
        if nodes and node_name not in nodes:
            raise ClaimError(
                f"ResourceClaim {ref.namespace}/{ref.name} is allocated for node "
                f"{', '.join(sorted(nodes))}, not this node {node_name}"
            )
    results = (allocation.get("devices") or {}).get("results") or []
    ours = [r for r in results if r.get("driver") == driver_name]
    if not ours:
        others = sorted({str(r.get("driver")) for r in results})
        raise ClaimError(
            f"ResourceClaim {ref.namespace}/{ref.name} has no allocation results for driver "
            f"{driver_name} (results are for: {', '.join(others) or 'none'})"
        )
    by_index = {g.index: g for g in gpus}
    devices: list[AllocatedDevice] = []
    for r in ours:
        name = str(r.get("device"))
        where = f"device {name}"
        pool = str(r.get("pool"))
        if pool != node_name:  # our pool is named after its node (driver/slicebuild.py)
            raise ClaimError(f"{where}: pool {pool} is not this node's pool {node_name}")
        gpu, memory, cores = _limits(r, name, where, by_index, mode, rules_for)
        request = str(r.get("request"))
        configs = _configs_for(allocation, driver_name, request)
        rules = rules_for(gpu)
        _check_claim_choices(configs, rules, where)
        admin = VgpuConfig(compute_policy=rules.compute_policy)
        config = EffectiveConfig.of([admin, *(c for _, c in configs)])
        if config.exclusive and mode == devicenames.SHARING:
            if cores != 100:
                raise ClaimError(
                    f"{where}: a whole-GPU claim (VgpuConfig exclusive, the "
                    f"vgpu-whole.sharing.dev class) holds {cores}% of the cores, so others could "
                    'share the GPU; allowed: request capacity cores: "100"'
                )
            memory = gpu.memory_total
        if config.memory_limit_override is not None:
            if config.memory_limit_override > memory:
                raise ClaimError(
                    f"{where}: VgpuConfig memoryLimitOverride "
                    f"{format_bytes(config.memory_limit_override)} exceeds the allocated "
                    f"{format_bytes(memory)}; it may only lower the limit"
                )
            memory = config.memory_limit_override
        burst_limit = _burst_limit(config, memory, gpu, rules, mode, where)
        devices.append(
            AllocatedDevice(
                request=request,
                pool=pool,
                device=name,
                gpu=gpu,
                memory_limit=memory,
                sm_limit=cores,
                share_id=r.get("shareID"),
                config=config,
                burst_limit=burst_limit,
            )
        )
    # The policy and priority reach the container as one env var each: they must agree.
    policies = {(d.config.compute_policy, d.config.priority) for d in devices}
    if len(policies) > 1:
        raise ClaimError(
            f"ResourceClaim {ref.namespace}/{ref.name}: VgpuConfig computePolicy/priority differ "
            "between its requests; a claim runs with one policy and priority"
        )
    return ClaimPlan(ref=ref, devices=tuple(devices), config=devices[0].config)


def _burst_limit(
    config: EffectiveConfig, request: int, gpu: GpuInfo, rules: Rules, mode: str, where: str
) -> int:
    """The device's burst limit in bytes (0: no bursting), held to the admin's `burst` policy
    (docs/policy.md): ClaimError, one line naming the field, the rule and what is allowed."""
    asked = config.memory_limit
    if asked is None:
        return 0
    limit = asked.of(request)
    field = f"{where}: VgpuConfig memoryLimit {asked.text}"
    if limit < request:
        raise ClaimError(
            f"{field} ({format_bytes(limit)}) is below the request {format_bytes(request)}; "
            "allowed: at least the request"
        )
    if limit == request:
        return 0
    if mode != devicenames.SHARING:
        raise ClaimError(
            f"{field}: partition mode offers no bursting; allowed: leave memoryLimit out"
        )
    b = rules.burst
    if not b.allowed:
        raise ClaimError(
            f"{field}: the node's sharing policy allows no bursting (burst.maxRatio: 1); "
            "allowed: leave memoryLimit out"
        )
    most = int(request * b.max_ratio)
    if b.max_limit is not None:
        most = min(most, b.max_limit)
    if limit > most:
        rule = f"burst.maxRatio: {b.max_ratio:g}"
        if b.max_limit is not None:
            rule += f", burst.maxLimit: {format_bytes(b.max_limit)}"
        raise ClaimError(
            f"{field} ({format_bytes(limit)}) is above what the node's sharing policy allows "
            f"for a request of {format_bytes(request)} ({rule}); allowed: at most "
            f"{format_bytes(most)}"
        )
    # never more than the device offers: a grant is bounded by the pool anyway
    return max(request, min(limit, rules.shareable_memory(gpu.memory_total)))


def _check_claim_choices(
    configs: Sequence[tuple[str, VgpuConfig]], rules: Rules, where: str
) -> None:
    """A claim's own config may only narrow what the admin allows: a compute policy the node's
    sharing policy lets claims choose, a priority no higher than its highestPriority. Class
    configs are the admin's (DeviceClasses are cluster-scoped), so they may choose anything,
    and a claim may name what the admin's policy and class give it anyway."""
    given = EffectiveConfig.of(
        [VgpuConfig(compute_policy=rules.compute_policy)]
        + [c for source, c in configs if "FromClaim" not in source]
    )
    highest = min(rules.highest_priority, given.priority)
    choices = [p for p in POLICIES if p == given.compute_policy or rules.claim_may_choose(p)]
    for source, c in configs:
        if "FromClaim" not in source:
            continue
        if c.memory_limit is not None and not rules.burst.from_claim:
            raise ClaimError(
                f"{where}: {source}: VgpuConfig memoryLimit {c.memory_limit.text}: the node's "
                "sharing policy lets only DeviceClass configs give a burst limit "
                "(burst.fromClaim: false); allowed: leave memoryLimit out, or use a DeviceClass "
                "that gives one"
            )
        if c.show_memory_limit and not rules.burst.show_limit:
            raise ClaimError(
                f"{where}: {source}: VgpuConfig showMemoryLimit true is not allowed by the "
                "node's sharing policy (burst.showLimit: false); allowed: false or leave it out"
            )
        if c.compute_policy is not None and c.compute_policy not in choices:
            raise ClaimError(
                f"{where}: {source}: VgpuConfig computePolicy {c.compute_policy!r} is not "
                f"allowed by the node's sharing policy (allowedComputePolicies: "
                f"[{', '.join(rules.allowed_compute_policies)}]); allowed: "
                f"{', '.join(choices)} or leave computePolicy out"
            )
        if c.priority is not None and c.priority < highest:
            raise ClaimError(
                f"{where}: {source}: VgpuConfig priority {c.priority} is higher than the node's "
                f"sharing policy allows (highestPriority: {rules.highest_priority}; lower is "
                f"served first); allowed: {highest}..{PRIORITY_MAX} or leave priority out"
            )


def _limits(
    result: dict[str, Any],
    name: str,
    where: str,
    by_index: dict[int, GpuInfo],
    mode: str,
    rules_for: RulesFor,
) -> tuple[GpuInfo, int, int]:
    parsed = devicenames.parse(name, mode)
    if parsed is None:
        form = (
            devicenames.PARTITION_FORM
            if mode == devicenames.PARTITION
            else devicenames.SHARING_FORM
        )
        raise ClaimError(f"{where}: not a device of this node in {mode} mode; allowed: {form}")
    gpu = by_index.get(parsed.gpu_index)
    if gpu is None:
        raise ClaimError(
            f"{where}: no GPU with index {parsed.gpu_index} on this node "
            f"(indices: {', '.join(str(i) for i in sorted(by_index)) or 'none'})"
        )
    if gpu.mig_enabled:
        raise ClaimError(
            f"{where}: GPU {gpu.index} ({gpu.uuid}) has MIG mode enabled; MIG is not supported "
            "yet (the plugin no longer offers this GPU)"
        )
    if mode == devicenames.PARTITION:
        rules = rules_for(gpu)
        if parsed.partition is None or not parsed.partition < rules.partitions:
            raise ClaimError(
                f"{where}: not a device of this node in partition mode; allowed: "
                f"{devicenames.PARTITION_FORM} with k in 0..{rules.partitions - 1}"
            )
        return gpu, rules.partition_memory(gpu.memory_total), rules.partition_cores()
    consumed = result.get("consumedCapacity") or {}
    memory = gpu.memory_total
    if MEMORY_CAPACITY in consumed:
        try:
            memory = kubequantity.parse_bytes(
                consumed[MEMORY_CAPACITY], f"{where}: consumed memory"
            )
        except kubequantity.KubeQuantityError as e:
            raise ClaimError(str(e)) from e
        if not 0 < memory <= gpu.memory_total:
            raise ClaimError(
                f"{where}: consumed memory {format_bytes(memory)} is outside 1 B.."
                f"{format_bytes(gpu.memory_total)} (the GPU's memory)"
            )
    if MEMORY_CAPACITY not in consumed:  # no consumable capacity: the whole shareable memory
        memory = rules_for(gpu).shareable_memory(gpu.memory_total) or gpu.memory_total
    cores = 100
    if CORES_CAPACITY in consumed:
        cores = _parse_cores(consumed[CORES_CAPACITY], where)
    return gpu, memory, cores

"""The admin's sharing policy, `vgpu.sharing.dev/v1alpha1 SharingPolicy` (docs/policy.md).

    apiVersion: vgpu.sharing.dev/v1alpha1
    kind: SharingPolicy
    default:
      reservedMemory: 2Gi
      memory: {min: 1Gi, step: 256Mi, default: 4Gi}
      cores: {min: 5, step: 5, default: 10}
      maxSharers: 8
      computePolicy: hard
      allowedComputePolicies: [hard, elastic]
      highestPriority: 0
      partitions: 4
      burst: {maxRatio: 2, maxLimit: 16Gi, fromClaim: false, reclaim: evict, grace: 10s}
    overrides:
    - match: {modelName: "NVIDIA A100*"}
      reservedMemory: 4Gi

Every field is optional; what the file leaves out comes from the built-in default (BUILTIN).
An override applies to a GPU when every key of its `match` matches (`modelName`: a shell glob
on the NVML name; `nodeLabels`: each key has that value on the Node); the first match wins and
its fields replace the default's (inside `memory`/`cores`/`burst`, field by field).

`burst` bounds a claim's memory limit above its request (docs/policy.md, "Memory that bursts
and is given back"): the built-in maxRatio 1 lets nothing burst.

A claim's own VgpuConfig may only narrow what the admin allows: `allowedComputePolicies` lists
the compute policies it may choose (besides the admin's `computePolicy`, which it may always
name), `highestPriority` the smallest priority number (the highest priority) it may ask for.
The built-in default lists none that lifts the SM cap (`off`). The deprecated
`allowPolicyOverride` is still read: `false` as `[]`, `true` as ALLOWED_DEFAULT (not `off`);
SharingPolicy.deprecations says so, for the plugin's log.

Memory sizes are Kubernetes quantities (sharing/kubequantity.py: `1500k` is 1,500,000 bytes,
`1e9` a billion; a value that is not a whole number of bytes, such as `512m`, is refused).
Loading is strict: unknown fields and bad values raise PolicyError, whose str() is one line
naming the field path (`overrides[0].memory.step`) and what is allowed. Both the plugin
(driver/) and the CLI can use this module; it imports nothing of `driver`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from sharing.kubequantity import FORMS, KubeQuantityError, parse_bytes, to_kubernetes
from sharing.limitsfile import HAMI_POLICIES, POLICIES

API_VERSION = "vgpu.sharing.dev/v1alpha1"
KIND = "SharingPolicy"
COMPUTE_POLICIES = tuple(p for p in POLICIES if p != "off")  # an admin default caps
# What a claim's own VgpuConfig may choose unless the admin says otherwise: every policy that
# keeps the slice's SM cap (elastic only borrows idle time and gives it back). `off` lifts the
# cap: a claim may choose it only where the admin lists it.
ALLOWED_DEFAULT = COMPUTE_POLICIES
PRIORITY_MIN, PRIORITY_MAX = -100, 100  # the shim's range (VGPU_PRIORITY); lower is served first
HIGHEST_PRIORITY_DEFAULT = 0  # CUDA's and HAMi's "high"; below 0 only the admin's classes
MAX_PARTITIONS = 64
MAX_SHARERS = 1024
CORES_TOTAL = 100  # percent of the GPU's SMs

_TOP_FIELDS = ("apiVersion", "kind", "default", "overrides")
_RULE_FIELDS = (
    "reservedMemory",
    "memory",
    "cores",
    "maxSharers",
    "computePolicy",
    "allowedComputePolicies",
    "highestPriority",
    "allowPolicyOverride",  # deprecated: read as allowedComputePolicies (docs/policy.md)
    "partitions",
    "burst",
)
_BURST_FIELDS = ("maxRatio", "maxLimit", "fromClaim", "reclaim", "grace", "timeout", "showLimit")
RECLAIM_POLICIES = ("evict", "wait")
MAX_BURST_RATIO = 64
GRACE_RANGE = (0.0, 30.0)  # seconds: evict's notice to stop
TIMEOUT_RANGE = (1.0, 40.0)  # seconds: wait's longest wait in one prepare (the kubelet's bound)
_RANGE_FIELDS = ("min", "step", "default")
_MATCH_FIELDS = ("modelName", "nodeLabels")


class PolicyError(ValueError):
    """A policy that is not valid. str() is one line: the field path, the value, what is allowed."""


@dataclass(frozen=True)
class Range:
    """A request policy: requests are rounded up to min + k*step; `default` is what a request
    that names no amount gets (None: the whole capacity)."""

    min: int
    step: int
    default: int | None = None

    def bounds(self, capacity: int) -> tuple[int, int, int] | None:
        """(min, max, default) for a capacity of this size, max and default rounded down onto
        the step grid; None when not even min + step fits (the capacity gets no policy)."""
        if capacity < self.min + self.step:
            return None
        top = self.min + (capacity - self.min) // self.step * self.step
        default = top if self.default is None else min(self.default, top)
        return self.min, top, default


@dataclass(frozen=True)
class Burst:
    """How far a claim's memory may burst above its request on a GPU, and how it is taken back
    (docs/policy.md, "Memory that bursts and is given back")."""

    max_ratio: float = 1.0  # limit <= max_ratio * request; 1: no bursting
    max_limit: int | None = None  # bytes; None: no bound besides max_ratio
    from_claim: bool = False  # may a claim's own VgpuConfig ask for a limit?
    reclaim: str = "evict"  # evict | wait
    grace: float = 10.0  # seconds (evict)
    timeout: float = 30.0  # seconds (wait)
    show_limit: bool = False  # may a claim opt in to see its limit as the total?

    @property
    def allowed(self) -> bool:
        return self.max_ratio > 1


@dataclass(frozen=True)
class Rules:
    """The resolved policy of one GPU."""

    reserved_memory: int = 0  # bytes held back from the memory capacity
    memory: Range = Range(min=256 * 1024**2, step=256 * 1024**2, default=None)
    cores: Range = Range(min=1, step=1, default=None)
    max_sharers: int = 16
    compute_policy: str = "hard"
    # what a claim's own VgpuConfig may choose besides compute_policy
    allowed_compute_policies: tuple[str, ...] = ALLOWED_DEFAULT
    highest_priority: int = HIGHEST_PRIORITY_DEFAULT  # a claim's priority must be >= this
    partitions: int = 4
    burst: Burst = Burst()

    def claim_may_choose(self, policy: str) -> bool:
        """May a claim's own VgpuConfig choose this compute policy?"""
        return policy == self.compute_policy or policy in self.allowed_compute_policies

    def shareable_memory(self, total: int) -> int:
        """The GPU's memory minus the reservation (never below zero)."""
        return max(0, total - self.reserved_memory)

    def partition_memory(self, total: int) -> int:
        return self.shareable_memory(total) // self.partitions

    def partition_cores(self) -> int:
        return max(1, CORES_TOTAL // self.partitions)


BUILTIN = Rules()


@dataclass(frozen=True)
class Match:
    model_name: str | None = None  # shell glob on the NVML name
    node_labels: Mapping[str, str] = field(default_factory=dict)

    def matches(self, model_name: str, node_labels: Mapping[str, str]) -> bool:
        if self.model_name is not None and not fnmatch.fnmatchcase(model_name, self.model_name):
            return False
        return all(node_labels.get(k) == v for k, v in self.node_labels.items())


@dataclass(frozen=True)
class Override:
    match: Match
    rules: Rules  # the default with this override's fields applied


@dataclass(frozen=True)
class SharingPolicy:
    default: Rules = BUILTIN
    overrides: tuple[Override, ...] = ()
    source: str = "built-in default"  # where it came from, for log lines
    # one line per deprecated field the file uses and how it was read (the plugin logs them)
    deprecations: tuple[str, ...] = ()

    def for_gpu(self, model_name: str, node_labels: Mapping[str, str]) -> Rules:
        """The rules of a GPU with this NVML name on a node with these labels."""
        for o in self.overrides:
            if o.match.matches(model_name, node_labels):
                return o.rules
        return self.default


# --- loading ---------------------------------------------------------------------------------------


def _fail(path: str, message: str) -> PolicyError:
    return PolicyError(f"{path}: {message}")


def _object(value: Any, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, f"must be a mapping with fields {', '.join(allowed)}")
    for key in value:
        if key not in allowed:
            raise _fail(f"{path}.{key}", f"unknown field; allowed: {', '.join(allowed)}")
    return value


def _memory(value: Any, path: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _fail(path, f"{value!r} is not a memory size; allowed: {FORMS}")
    try:
        n = parse_bytes(value, path)
    except KubeQuantityError as e:
        raise PolicyError(str(e)) from None
    if n == 0 and not allow_zero:
        raise _fail(path, "must be more than 0 bytes")
    return n


def _int(value: Any, path: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _fail(path, f"{value!r} invalid; allowed: an integer {lo}..{hi}")
    return value


def _cores(value: Any, path: str) -> int:
    # "25" as a string is what a quantity-minded admin may write; accept it.
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return _int(value, path, 1, CORES_TOTAL)


_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0}


def _duration(value: Any, path: str, lo: float, hi: float) -> float:
    """A duration such as `10s`, `500ms`, `1m` (or a number of seconds) within lo..hi seconds."""
    allowed = f"a duration {lo:g}s..{hi:g}s (such as 10s, 500ms)"
    if isinstance(value, bool):
        raise _fail(path, f"{value!r} invalid; allowed: {allowed}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.fullmatch(value.strip())):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise _fail(path, f"{value!r} invalid; allowed: {allowed}")
    if not lo <= seconds <= hi:
        raise _fail(path, f"{value!r} invalid; allowed: {allowed}")
    return seconds


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, f"{value!r} invalid; allowed: true, false")
    return value


def _burst(value: Any, path: str, base: Burst) -> Burst:
    raw = _object(value, path, _BURST_FIELDS)
    b = base
    if "maxRatio" in raw:
        r = raw["maxRatio"]
        if isinstance(r, bool) or not isinstance(r, int | float) or not 1 <= r <= MAX_BURST_RATIO:
            raise _fail(
                f"{path}.maxRatio",
                f"{r!r} invalid; allowed: a number 1..{MAX_BURST_RATIO} (1: no bursting)",
            )
        b = replace(b, max_ratio=float(r))
    if "maxLimit" in raw:
        b = replace(b, max_limit=_memory(raw["maxLimit"], f"{path}.maxLimit"))
    if "fromClaim" in raw:
        b = replace(b, from_claim=_bool(raw["fromClaim"], f"{path}.fromClaim"))
    if "reclaim" in raw:
        how = raw["reclaim"]
        if how not in RECLAIM_POLICIES:
            allowed = ", ".join(RECLAIM_POLICIES)
            also = " (migrate is not implemented)" if how == "migrate" else ""
            raise _fail(f"{path}.reclaim", f"{how!r} invalid; allowed: {allowed}{also}")
        b = replace(b, reclaim=how)
    if "grace" in raw:
        b = replace(b, grace=_duration(raw["grace"], f"{path}.grace", *GRACE_RANGE))
    if "timeout" in raw:
        b = replace(b, timeout=_duration(raw["timeout"], f"{path}.timeout", *TIMEOUT_RANGE))
    if "showLimit" in raw:
        b = replace(b, show_limit=_bool(raw["showLimit"], f"{path}.showLimit"))
    return b


def _range(value: Any, path: str, base: Range, memory: bool) -> Range:
    raw = _object(value, path, _RANGE_FIELDS)

    def get(name: str, current: int | None) -> int | None:
        if name not in raw:
            return current
        where = f"{path}.{name}"
        return _memory(raw[name], where) if memory else _cores(raw[name], where)

    lo = get("min", base.min)
    step = get("step", base.step)
    assert lo is not None and step is not None
    return Range(min=lo, step=step, default=get("default", base.default))


def _check_range(r: Range, path: str, memory: bool) -> None:
    show = to_kubernetes if memory else (lambda n: f"{n}%")
    if r.default is not None:
        if r.default < r.min:
            raise _fail(
                f"{path}.default", f"{show(r.default)} is below min {show(r.min)}; allowed: >= min"
            )
        if (r.default - r.min) % r.step:
            raise _fail(
                f"{path}.default",
                f"{show(r.default)} is not min + a multiple of step ({show(r.min)} + "
                f"k*{show(r.step)}); Kubernetes requires it",
            )
    if not memory and r.min + r.step > CORES_TOTAL:
        raise _fail(
            f"{path}.step",
            f"min + step is {r.min + r.step}%; allowed: at most {CORES_TOTAL}% (one step must fit)",
        )


def _rules(
    raw: Any, path: str, base: Rules, notes: list[str] | None = None
) -> tuple[Rules, dict[str, Any]]:
    """base with the rule fields of raw applied; also returns the fields that are not rules.
    A deprecated field adds a line saying how it was read to notes."""
    notes = [] if notes is None else notes
    if not isinstance(raw, dict):
        raise _fail(path, f"must be a mapping with fields {', '.join(_RULE_FIELDS)}")
    r = base
    if "reservedMemory" in raw:
        r = replace(
            r, reserved_memory=_memory(raw["reservedMemory"], f"{path}.reservedMemory", True)
        )
    if "memory" in raw:
        r = replace(r, memory=_range(raw["memory"], f"{path}.memory", r.memory, True))
    if "cores" in raw:
        r = replace(r, cores=_range(raw["cores"], f"{path}.cores", r.cores, False))
    if "maxSharers" in raw:
        r = replace(r, max_sharers=_int(raw["maxSharers"], f"{path}.maxSharers", 1, MAX_SHARERS))
    if "computePolicy" in raw:
        policy = raw["computePolicy"]
        if policy not in COMPUTE_POLICIES:
            raise _fail(
                f"{path}.computePolicy",
                f"{policy!r} invalid; allowed: {', '.join(COMPUTE_POLICIES)}",
            )
        r = replace(r, compute_policy=policy)
    if "allowedComputePolicies" in raw:
        if "allowPolicyOverride" in raw:
            raise _fail(
                f"{path}.allowPolicyOverride",
                "deprecated, and allowedComputePolicies is given too; allowed: "
                "allowedComputePolicies alone",
            )
        r = replace(
            r,
            allowed_compute_policies=_policy_list(
                raw["allowedComputePolicies"], f"{path}.allowedComputePolicies"
            ),
        )
    elif "allowPolicyOverride" in raw:
        allow = raw["allowPolicyOverride"]
        if not isinstance(allow, bool):
            raise _fail(
                f"{path}.allowPolicyOverride",
                f"{allow!r} invalid; allowed: true, false (deprecated: use allowedComputePolicies)",
            )
        allowed = ALLOWED_DEFAULT if allow else ()
        note = (
            f"{path}.allowPolicyOverride: {str(allow).lower()} is deprecated; read as "
            f"allowedComputePolicies: [{', '.join(allowed)}]"
        )
        if allow:
            note += " (no longer off: list off there to let claims switch their SM cap off)"
        notes.append(note)
        r = replace(r, allowed_compute_policies=allowed)
    if "highestPriority" in raw:
        r = replace(
            r,
            highest_priority=_int(
                raw["highestPriority"], f"{path}.highestPriority", PRIORITY_MIN, PRIORITY_MAX
            ),
        )
    if "partitions" in raw:
        r = replace(r, partitions=_int(raw["partitions"], f"{path}.partitions", 1, MAX_PARTITIONS))
    if "burst" in raw:
        r = replace(r, burst=_burst(raw["burst"], f"{path}.burst", r.burst))
    _check_range(r.memory, f"{path}.memory", True)
    _check_range(r.cores, f"{path}.cores", False)
    rest = {k: v for k, v in raw.items() if k not in _RULE_FIELDS}
    return r, rest


def _policy_list(value: Any, path: str) -> tuple[str, ...]:
    """A list of compute policies (each once, in POLICIES order), or PolicyError."""
    allowed = f"a list of {', '.join(POLICIES)} ([] for none)"
    if not isinstance(value, list):
        raise _fail(path, f"{value!r} invalid; allowed: {allowed}")
    for item in value:
        if item not in POLICIES:
            hami = HAMI_POLICIES.get(item) if isinstance(item, str) else None
            also = f" ({item!r} is HAMi's name for {hami})" if hami else ""
            raise _fail(path, f"{item!r} invalid; allowed: {allowed}{also}")
    return tuple(p for p in POLICIES if p in value)


def _match(raw: Any, path: str) -> Match:
    m = _object(raw, path, _MATCH_FIELDS)
    if not m:
        raise _fail(path, f"empty; allowed: {', '.join(_MATCH_FIELDS)} (an empty match is default)")
    model = m.get("modelName")
    if model is not None and (not isinstance(model, str) or not model):
        raise _fail(f"{path}.modelName", f"{model!r} invalid; allowed: a non-empty glob string")
    labels = m.get("nodeLabels", {})
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise _fail(
            f"{path}.nodeLabels", "invalid; allowed: a mapping of label key to string value"
        )
    return Match(model_name=model, node_labels=dict(labels))


def from_document(doc: Any, base: Rules = BUILTIN, source: str = "policy") -> SharingPolicy:
    """A SharingPolicy from a parsed YAML/JSON document, or PolicyError."""
    top = _object(doc, "policy", _TOP_FIELDS)
    if top.get("apiVersion") != API_VERSION:
        raise _fail("apiVersion", f"{top.get('apiVersion')!r} unsupported; allowed: {API_VERSION}")
    if top.get("kind") != KIND:
        raise _fail("kind", f"{top.get('kind')!r} unsupported; allowed: {KIND}")
    default = base
    notes: list[str] = []
    if top.get("default") is not None:
        _object(top["default"], "default", _RULE_FIELDS)
        default, _ = _rules(top["default"], "default", base, notes)
    raw_overrides = top.get("overrides") or []
    if not isinstance(raw_overrides, list):
        raise _fail("overrides", "must be a list of {match: ..., <fields of default>}")
    overrides = []
    for i, raw in enumerate(raw_overrides):
        path = f"overrides[{i}]"
        _object(raw, path, ("match", *_RULE_FIELDS))
        if "match" not in raw:
            raise _fail(f"{path}.match", "required; allowed: modelName and/or nodeLabels")
        rules, _ = _rules(raw, path, default, notes)
        overrides.append(Override(match=_match(raw["match"], f"{path}.match"), rules=rules))
    return SharingPolicy(
        default=default, overrides=tuple(overrides), source=source, deprecations=tuple(notes)
    )


CONFIGMAP_KEY = "policy.yaml"  # the key of deploy/base/policy.yaml that the pod mounts as the file


def unwrap_configmap(doc: Any) -> Any:
    """The policy inside the ConfigMap that deploy/ ships (its data.policy.yaml), so the same
    file serves `kubectl apply` and `--policy` / `--dry-run`; any other document as it is."""
    if not (isinstance(doc, dict) and doc.get("kind") == "ConfigMap"):
        return doc
    data = doc.get("data")
    if not isinstance(data, dict) or not isinstance(data.get(CONFIGMAP_KEY), str):
        keys = ", ".join(sorted(map(str, data))) if isinstance(data, dict) else "none"
        raise _fail(
            "data",
            f"a ConfigMap whose data has no {CONFIGMAP_KEY} (its keys: {keys}); the policy is "
            f"the text of data.{CONFIGMAP_KEY}, or give the SharingPolicy document itself",
        )
    return _parse_yaml(data[CONFIGMAP_KEY], f"data.{CONFIGMAP_KEY}")


def _parse_yaml(text: str, what: str) -> Any:
    """The document in text, or PolicyError '<what>: not valid YAML...' in one line."""
    try:
        return yaml.safe_load(text)
    except RecursionError:  # the parser recurses once per level: [[[[...]]]]
        raise _fail(
            what,
            "not valid YAML: nested too deeply; allowed: a SharingPolicy document "
            "(a few levels of mappings and lists)",
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "not YAML"
        raise _fail(what, f"not valid YAML{where}: {problem}") from None


def load(path: Path, base: Rules = BUILTIN) -> SharingPolicy:
    """Read and validate a policy file (YAML or JSON). PolicyError names the file."""
    try:
        text = path.read_text()
    except OSError as e:
        raise PolicyError(f"{path}: cannot read: {e.strerror or e}") from None
    doc = _parse_yaml(text, str(path))
    try:
        return from_document(unwrap_configmap(doc), base, source=str(path))
    except PolicyError as e:
        raise PolicyError(f"{path}: {e}") from None

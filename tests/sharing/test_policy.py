"""The admin sharing policy file (sharing/policy.py): the issue's example, defaults, matching,
and one-line errors that name the field path and what is allowed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharing import kubequantity
from sharing.policy import (
    BUILTIN,
    Burst,
    PolicyError,
    Range,
    SharingPolicy,
    from_document,
    load,
)

GiB = 1024**3
MiB = 1024**2
REPO = Path(__file__).resolve().parents[2]

EXAMPLE = """\
apiVersion: vgpu.sharing.dev/v1alpha1
kind: SharingPolicy
default:
  reservedMemory: 2Gi          # held back from every GPU's memory capacity (driver, contexts)
  memory: {min: 1Gi, step: 256Mi, default: 4Gi}   # requestPolicy of the memory capacity
  cores: {min: 5, step: 5, default: 10}           # requestPolicy of the cores capacity (percent)
  maxSharers: 8                # published as capacity "sharers"; every allocation consumes exactly 1
  computePolicy: hard          # hard | elastic: the default for claims that do not choose
  allowedComputePolicies: [hard, elastic]   # what a claim's own VgpuConfig may choose (off: uncapped)
  highestPriority: 0           # the lowest priority number a claim's own VgpuConfig may ask for
  partitions: 4                # partition mode
overrides:                     # first match wins; any field of default may be set
- match: {modelName: "NVIDIA A100*"}        # glob on the NVML name, or nodeLabels: {key: value}
  reservedMemory: 4Gi
"""


def doc(**default: Any) -> dict[str, Any]:
    return {"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "SharingPolicy", "default": default}


def test_the_issue_example_loads(tmp_path: Path) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text(EXAMPLE)
    p = load(f)
    d = p.default
    assert d.reserved_memory == 2 * GiB
    assert d.memory == Range(min=GiB, step=256 * MiB, default=4 * GiB)
    assert d.cores == Range(min=5, step=5, default=10)
    assert (d.max_sharers, d.compute_policy, d.partitions) == (8, "hard", 4)
    assert (d.allowed_compute_policies, d.highest_priority) == (("hard", "elastic"), 0)
    assert p.deprecations == ()
    a100 = p.for_gpu("NVIDIA A100-SXM4-40GB", {})
    assert a100.reserved_memory == 4 * GiB
    assert a100.memory == d.memory  # an override changes only what it names
    assert p.for_gpu("NVIDIA H100 80GB HBM3", {}) == d


def test_shipped_configmap_policy_is_valid() -> None:
    """The policy the deploy tree ships in its ConfigMap loads without error."""
    path = REPO / "deploy" / "base" / "policy.yaml"
    [cm] = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "ConfigMap"]
    raw = yaml.safe_load(cm["data"]["policy.yaml"])["default"]
    d = from_document(yaml.safe_load(cm["data"]["policy.yaml"])).default
    # every field the file sets is in force, read with Kubernetes' quantity rules
    assert d.reserved_memory == kubequantity.parse_bytes(raw["reservedMemory"])
    assert d.memory.min == kubequantity.parse_bytes(raw["memory"]["min"])
    assert d.memory.default == kubequantity.parse_bytes(raw["memory"]["default"])
    assert (d.cores.min, d.cores.step, d.cores.default) == tuple(
        raw["cores"][k] for k in ("min", "step", "default")
    )
    assert (d.max_sharers, d.compute_policy, d.partitions) == (
        raw["maxSharers"],
        raw["computePolicy"],
        raw["partitions"],
    )
    assert d.allowed_compute_policies == tuple(raw["allowedComputePolicies"])
    assert d.highest_priority == raw["highestPriority"]


@pytest.mark.parametrize("where", ["shipped", "built-in"])
def test_the_shipped_policies_let_no_claim_lift_its_cap(where: str) -> None:
    """Issue 33 part 4: deploy/base/policy.yaml and the built-in default shipped
    `allowPolicyOverride: true`, so a claim's own VgpuConfig could choose `off` (no SM cap) and
    priority -100. Neither may now: a claim may choose hard or elastic, priority 0..100."""
    if where == "shipped":
        path = REPO / "deploy" / "base" / "policy.yaml"
        [cm] = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "ConfigMap"]
        rules = from_document(yaml.safe_load(cm["data"]["policy.yaml"])).default
    else:
        rules = BUILTIN
    assert not rules.claim_may_choose("off")
    assert [p for p in ("hard", "elastic") if rules.claim_may_choose(p)] == ["hard", "elastic"]
    assert rules.highest_priority == 0


def test_allowed_compute_policies_may_list_off_or_none() -> None:
    off = from_document(doc(allowedComputePolicies=["off", "hard", "off"])).default
    assert off.allowed_compute_policies == ("hard", "off")  # each once, in POLICIES order
    assert off.claim_may_choose("off") and not off.claim_may_choose("elastic")
    none = from_document(doc(computePolicy="elastic", allowedComputePolicies=[])).default
    assert [p for p in ("hard", "elastic", "off") if none.claim_may_choose(p)] == ["elastic"]
    assert from_document(doc(highestPriority=-100)).default.highest_priority == -100


@pytest.mark.parametrize(
    ("allow", "allowed", "note"),
    [
        (
            True,
            ("hard", "elastic"),
            "default.allowPolicyOverride: true is deprecated; read as allowedComputePolicies: "
            "[hard, elastic] (no longer off: list off there to let claims switch their SM cap off)",
        ),
        (
            False,
            (),
            "default.allowPolicyOverride: false is deprecated; read as allowedComputePolicies: []",
        ),
    ],
)
def test_the_deprecated_allow_policy_override_is_read_as_a_list(
    allow: bool, allowed: tuple[str, ...], note: str
) -> None:
    """Old policies keep loading; `true` no longer lets a claim choose off."""
    p = from_document(doc(allowPolicyOverride=allow))
    assert p.default.allowed_compute_policies == allowed
    assert not p.default.claim_may_choose("off")
    assert p.deprecations == (note,)


def test_no_file_means_the_builtin_default() -> None:
    assert SharingPolicy().for_gpu("anything", {}) is BUILTIN
    assert BUILTIN.reserved_memory == 0
    assert BUILTIN.memory == Range(min=256 * MiB, step=256 * MiB, default=None)
    assert BUILTIN.cores == Range(min=1, step=1, default=None)
    assert BUILTIN.max_sharers == 16 and BUILTIN.compute_policy == "hard"
    # An empty default keeps everything built in.
    assert from_document(doc()).default == BUILTIN


def test_overrides_first_match_wins_and_node_labels() -> None:
    p = from_document(
        doc(maxSharers=4)
        | {
            "overrides": [
                {"match": {"nodeLabels": {"pool": "inference"}}, "maxSharers": 32},
                {"match": {"modelName": "*H100*"}, "maxSharers": 2, "partitions": 7},
            ]
        }
    )
    assert p.for_gpu("NVIDIA H100", {"pool": "inference"}).max_sharers == 32
    h100 = p.for_gpu("NVIDIA H100", {"pool": "training"})
    assert (h100.max_sharers, h100.partitions) == (2, 7)
    assert p.for_gpu("NVIDIA L4", {}).max_sharers == 4
    # Globs are case-sensitive, as NVML names are exact.
    assert p.for_gpu("nvidia h100", {}).max_sharers == 4


def test_range_bounds_round_onto_the_step_grid() -> None:
    r = Range(min=GiB, step=256 * MiB, default=4 * GiB)
    assert r.bounds(10 * GiB + 100) == (GiB, 10 * GiB, 4 * GiB)
    assert r.bounds(3 * GiB) == (GiB, 3 * GiB, 3 * GiB)  # default capped at max
    assert r.bounds(GiB + 255 * MiB) is None  # not even min + step fits
    assert Range(min=1, step=1).bounds(100) == (1, 100, 100)
    assert Range(min=5, step=10).bounds(100) == (5, 95, 95)


def test_memory_sizes_are_kubernetes_quantities() -> None:
    """A ConfigMap speaks Kubernetes: k is 1000, exponents work (not HAMi's binary k)."""
    p = from_document(doc(reservedMemory="1500k", memory={"min": "1e9", "step": "1G"})).default
    assert p.reserved_memory == 1_500_000
    assert (p.memory.min, p.memory.step) == (10**9, 10**9)
    assert from_document(doc(reservedMemory=1073741824)).default.reserved_memory == GiB


def test_reserved_memory_and_partitions() -> None:
    p = from_document(doc(reservedMemory="2Gi", partitions=3)).default
    assert p.shareable_memory(80 * GiB) == 78 * GiB
    assert p.partition_memory(80 * GiB) == 26 * GiB
    assert p.partition_cores() == 33
    assert p.shareable_memory(GiB) == 0


def test_the_builtin_burst_policy_allows_no_bursting() -> None:
    b = from_document(doc()).default.burst
    assert b == Burst() and not b.allowed
    assert (b.max_ratio, b.max_limit, b.from_claim, b.reclaim, b.grace, b.timeout,
            b.show_limit) == (1.0, None, False, "evict", 10.0, 30.0, False)  # fmt: skip


def test_burst_fields_and_overrides_field_by_field() -> None:
    p = from_document(
        doc(burst={"maxRatio": 2.5, "maxLimit": "16Gi", "grace": "500ms", "timeout": "40s",
                   "showLimit": True})
        | {"overrides": [{"match": {"modelName": "*A100*"},
                          "burst": {"reclaim": "wait", "fromClaim": True}}]}
    )  # fmt: skip
    d = p.default.burst
    assert (d.max_ratio, d.max_limit, d.grace, d.timeout, d.show_limit) == (
        2.5, 16 * GiB, 0.5, 40.0, True)  # fmt: skip
    assert d.allowed and d.reclaim == "evict" and not d.from_claim
    a100 = p.for_gpu("NVIDIA A100-SXM4-80GB", {}).burst
    assert a100 == replace(d, reclaim="wait", from_claim=True)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "policy: must be a mapping"),
        (
            {"kind": "SharingPolicy"},
            "apiVersion: None unsupported; allowed: vgpu.sharing.dev/v1alpha1",
        ),
        (doc() | {"kind": "Policy"}, "kind: 'Policy' unsupported; allowed: SharingPolicy"),
        (doc() | {"extra": 1}, "policy.extra: unknown field; allowed: apiVersion, kind"),
        (doc(reservedMemory="2 GB"), "default.reservedMemory: '2 GB' is not a quantity"),
        (doc(reservedMemory="512m"), "default.reservedMemory: '512m' is 0.512 bytes, not a whole"),
        (doc(reservedMemory="4g"), "default.reservedMemory: '4g' is not a quantity"),
        (doc(reservedMemory="-1Gi"), "default.reservedMemory: '-1Gi' is negative"),
        (doc(reservedMemory=True), "default.reservedMemory: True is not a memory size"),
        (doc(memory={"min": "0"}), "default.memory.min: must be more than 0 bytes"),
        (
            doc(memory={"max": "8Gi"}),
            "default.memory.max: unknown field; allowed: min, step, default",
        ),
        (
            doc(memory={"min": "1Gi", "step": "1Gi", "default": "1536Mi"}),
            "default.memory.default: 1536Mi is not min + a multiple of step (1Gi + k*1Gi)",
        ),
        (
            doc(memory={"min": "1Gi", "default": "512Mi"}),
            "default.memory.default: 512Mi is below min 1Gi",
        ),
        (doc(cores={"min": 0}), "default.cores.min: 0 invalid; allowed: an integer 1..100"),
        (doc(cores={"min": 60, "step": 50}), "default.cores.step: min + step is 110%"),
        (doc(cores={"step": 2.5}), "default.cores.step: 2.5 invalid; allowed: an integer 1..100"),
        (doc(maxSharers=0), "default.maxSharers: 0 invalid; allowed: an integer 1..1024"),
        (doc(computePolicy="off"), "default.computePolicy: 'off' invalid; allowed: hard, elastic"),
        (
            doc(allowPolicyOverride="yes"),
            "default.allowPolicyOverride: 'yes' invalid; allowed: true, false (deprecated: use "
            "allowedComputePolicies)",
        ),
        (
            doc(allowPolicyOverride=True, allowedComputePolicies=["hard"]),
            "default.allowPolicyOverride: deprecated, and allowedComputePolicies is given too; "
            "allowed: allowedComputePolicies alone",
        ),
        (
            doc(allowedComputePolicies="off"),
            "default.allowedComputePolicies: 'off' invalid; allowed: a list of hard, elastic, off "
            "([] for none)",
        ),
        (
            doc(allowedComputePolicies=["hard", "force"]),
            "default.allowedComputePolicies: 'force' invalid; allowed: a list of hard, elastic, "
            "off ([] for none) ('force' is HAMi's name for hard)",
        ),
        (
            doc(highestPriority=-101),
            "default.highestPriority: -101 invalid; allowed: an integer -100..100",
        ),
        (
            doc() | {"overrides": [{"match": {"modelName": "*"}, "highestPriority": "0"}]},
            "overrides[0].highestPriority: '0' invalid; allowed: an integer -100..100",
        ),
        (doc(partitions=65), "default.partitions: 65 invalid; allowed: an integer 1..64"),
        (
            doc(burst={"maxRatio": 0.5}),
            "default.burst.maxRatio: 0.5 invalid; allowed: a number 1..64 (1: no bursting)",
        ),
        (doc(burst={"maxRatio": True}), "default.burst.maxRatio: True invalid; allowed: a number"),
        (doc(burst={"maxRatio": 65}), "default.burst.maxRatio: 65 invalid; allowed: a number"),
        (doc(burst={"maxLimit": "0"}), "default.burst.maxLimit: must be more than 0 bytes"),
        (doc(burst={"maxLimit": "4g"}), "default.burst.maxLimit: '4g' is not a quantity"),
        (doc(burst={"fromClaim": "yes"}), "default.burst.fromClaim: 'yes' invalid; allowed: true"),
        (
            doc(burst={"reclaim": "migrate"}),
            "default.burst.reclaim: 'migrate' invalid; allowed: evict, wait (migrate is not "
            "implemented)",
        ),
        (
            doc(burst={"grace": "31s"}),
            "default.burst.grace: '31s' invalid; allowed: a duration 0s..30s",
        ),
        (doc(burst={"grace": "10"}), "default.burst.grace: '10' invalid; allowed: a duration"),
        (
            doc(burst={"timeout": "500ms"}),
            "default.burst.timeout: '500ms' invalid; allowed: a duration 1s..40s",
        ),
        (doc(burst={"showLimit": 1}), "default.burst.showLimit: 1 invalid; allowed: true, false"),
        (
            doc(burst={"ratio": 2}),
            "default.burst.ratio: unknown field; allowed: maxRatio, maxLimit, fromClaim, reclaim, "
            "grace, timeout, showLimit",
        ),
        (doc(burst=2), "default.burst: must be a mapping with fields maxRatio"),
        (
            doc() | {"overrides": [{"match": {"modelName": "*"}, "burst": {"grace": "1h"}}]},
            "overrides[0].burst.grace: '1h' invalid",
        ),
        (doc(sharers=3), "default.sharers: unknown field; allowed: reservedMemory, memory"),
        (doc() | {"overrides": {"a": 1}}, "overrides: must be a list"),
        (doc() | {"overrides": [{"maxSharers": 2}]}, "overrides[0].match: required"),
        (
            doc() | {"overrides": [{"match": {"gpu": "x"}}]},
            "overrides[0].match.gpu: unknown field; allowed: modelName, nodeLabels",
        ),
        (doc() | {"overrides": [{"match": {}}]}, "overrides[0].match: empty"),
        (
            doc() | {"overrides": [{"match": {"nodeLabels": {"a": 1}}}]},
            "overrides[0].match.nodeLabels: invalid; allowed: a mapping",
        ),
        (
            doc()
            | {"overrides": [{"match": {"modelName": "*"}, "cores": {"default": 7, "step": 5}}]},
            "overrides[0].cores.default: 7% is not min + a multiple of step",
        ),
    ],
)
def test_errors_name_the_field_and_what_is_allowed(document: Any, message: str) -> None:
    with pytest.raises(PolicyError) as e:
        from_document(document)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(message), text


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    with pytest.raises(PolicyError, match=r"p.yaml: cannot read"):
        load(f)
    f.write_text("default: [unclosed\n")
    with pytest.raises(PolicyError, match=r"p.yaml: not valid YAML at line 2"):
        load(f)
    f.write_text(yaml.safe_dump(doc(maxSharers=-1)))
    with pytest.raises(PolicyError, match=r"p.yaml: default.maxSharers: -1 invalid"):
        load(f)


def test_the_configmap_is_read_through_its_policy_key(tmp_path: Path) -> None:
    """`--policy deploy/base/policy.yaml`: the ConfigMap that `kubectl apply` takes is the file an
    admin has at hand; its data.policy.yaml is the policy, and anything else is said in a line."""
    shipped = load(REPO / "deploy" / "base" / "policy.yaml")
    [cm] = [
        d
        for d in yaml.safe_load_all((REPO / "deploy" / "base" / "policy.yaml").read_text())
        if d and d["kind"] == "ConfigMap"
    ]
    assert shipped.default == from_document(yaml.safe_load(cm["data"]["policy.yaml"])).default
    f = tmp_path / "cm.yaml"
    f.write_text(yaml.safe_dump({"kind": "ConfigMap", "data": {"other.yaml": "x"}}))
    with pytest.raises(PolicyError) as e:
        load(f)
    assert str(e.value) == (
        f"{f}: data: a ConfigMap whose data has no policy.yaml (its keys: other.yaml); the policy "
        "is the text of data.policy.yaml, or give the SharingPolicy document itself"
    )
    f.write_text(yaml.safe_dump({"kind": "ConfigMap", "data": {"policy.yaml": "a: [b\n"}}))
    with pytest.raises(PolicyError, match=r"cm.yaml: data.policy.yaml: not valid YAML at line 2"):
        load(f)


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    ["[" * 100_000 + "]" * 100_000, "{a: " * 100_000 + "1" + "}" * 100_000,
     "default:\n" + "".join(" " * i + "- \n" for i in range(1, 3000))],
    ids=["lists", "mappings", "block-lists"],
)  # fmt: skip
def test_a_document_nested_100k_deep_is_one_line(tmp_path: Path, text: str) -> None:
    f = tmp_path / "deep.yaml"
    f.write_text(text)
    with pytest.raises(PolicyError) as e:
        load(f)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{f}: "), msg

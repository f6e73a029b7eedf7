"""A claim's burst limit (docs/policy.md, "Memory that bursts and is given back"): VgpuConfig's
`memoryLimit` / `showMemoryLimit` held to the admin's `burst` policy in driver/claims.py. Every
refusal is one line naming the field, the rule and what is allowed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from driver.claims import ClaimError, ClaimRef, plan_claim
from driver.vgpuconfig import ConfigError, MemoryLimit, decode
from sharing.policy import BUILTIN, Burst, Rules
from tests.driver.kubelet_standin import DRIVER, allocated_claim, result, vgpu_config
from tests.driver.plugin_process import fake_gpus

GiB = 1024**3
REF = ClaimRef("default", "c", "uid-1")
BURSTY = replace(BUILTIN, burst=Burst(max_ratio=2, max_limit=12 * GiB))


def plan(claim: dict[str, Any], rules: Rules = BURSTY, mode: str = "sharing") -> Any:
    claim["metadata"]["uid"] = REF.uid
    return plan_claim(claim, REF, driver_name=DRIVER, node_name="node-a", gpus=fake_gpus(),
                      mode=mode, partitions=4, rules_for=lambda _g: rules)  # fmt: skip


def claim(*configs: Any, memory: str = "4Gi", device: str = "gpu-0") -> dict[str, Any]:
    return allocated_claim("c", results=[result("gpu", device, memory=memory, cores="10")],
                           configs=list(configs))  # fmt: skip


def test_a_class_limit_within_the_policy_bursts() -> None:
    p = plan(claim(vgpu_config("FromClass", {"memoryLimit": "2x"})))
    (g,) = p.gpu_limits()
    assert (g.memory_limit, g.burst_limit, g.bursts) == (4 * GiB, 8 * GiB, True)
    assert not p.show_limit
    p = plan(claim(vgpu_config("FromClass", {"memoryLimit": "6Gi", "showMemoryLimit": True})))
    (g,) = p.gpu_limits()
    assert (g.burst_limit, p.show_limit) == (6 * GiB, True)


def test_no_limit_or_a_limit_equal_to_the_request_does_not_burst() -> None:
    for c in (claim(), claim(vgpu_config("FromClass", {"memoryLimit": "1x"}))):
        (g,) = plan(c).gpu_limits()
        assert not g.bursts and g.burst_limit == 0
    # showMemoryLimit without a limit above the request changes nothing
    p = plan(claim(vgpu_config("FromClass", {"showMemoryLimit": True})))
    assert not p.show_limit


def test_a_later_config_wins_field_by_field() -> None:
    p = plan(claim(vgpu_config("FromClass", {"memoryLimit": "2x"}),
                   vgpu_config("FromClass", {"memoryLimit": "5Gi"})))  # fmt: skip
    assert p.gpu_limits()[0].burst_limit == 5 * GiB


def test_the_limit_is_bounded_by_what_the_device_offers() -> None:
    rules = replace(BURSTY, reserved_memory=70 * GiB, burst=Burst(max_ratio=64))
    p = plan(claim(vgpu_config("FromClass", {"memoryLimit": "4x"})), rules)
    assert p.gpu_limits()[0].burst_limit == 10 * GiB  # 80 GiB - 70 GiB reserved


@pytest.mark.parametrize(
    ("rules", "configs", "message"),
    [
        (BUILTIN, [vgpu_config("FromClass", {"memoryLimit": "2x"})],
         "device gpu-0: VgpuConfig memoryLimit 2x: the node's sharing policy allows no bursting "
         "(burst.maxRatio: 1); allowed: leave memoryLimit out"),
        (BURSTY, [vgpu_config("FromClass", {"memoryLimit": "3Gi"})],
         "device gpu-0: VgpuConfig memoryLimit 3Gi (3.00 GiB) is below the request 4.00 GiB; "
         "allowed: at least the request"),
        (BURSTY, [vgpu_config("FromClass", {"memoryLimit": "2.5x"})],
         "device gpu-0: VgpuConfig memoryLimit 2.5x (10.0 GiB) is above what the node's sharing "
         "policy allows for a request of 4.00 GiB (burst.maxRatio: 2, burst.maxLimit: 12.0 GiB); "
         "allowed: at most 8.00 GiB"),
        (replace(BURSTY, burst=Burst(max_ratio=4, max_limit=6 * GiB)),
         [vgpu_config("FromClass", {"memoryLimit": "8Gi"})],
         "is above what the node's sharing policy allows for a request of 4.00 GiB "
         "(burst.maxRatio: 4, burst.maxLimit: 6.00 GiB); allowed: at most 6.00 GiB"),
        (BURSTY, [vgpu_config("FromClaim", {"memoryLimit": "2x"})],
         "device gpu-0: config[0] (FromClaim): VgpuConfig memoryLimit 2x: the node's sharing "
         "policy lets only DeviceClass configs give a burst limit (burst.fromClaim: false); "
         "allowed: leave memoryLimit out, or use a DeviceClass that gives one"),
        (BURSTY, [vgpu_config("FromClass", {"memoryLimit": "2x"}),
                  vgpu_config("FromClaim", {"showMemoryLimit": True})],
         "device gpu-0: config[1] (FromClaim): VgpuConfig showMemoryLimit true is not allowed by "
         "the node's sharing policy (burst.showLimit: false); allowed: false or leave it out"),
    ],
)  # fmt: skip
def test_refusals_name_the_field_the_rule_and_what_is_allowed(
    rules: Rules, configs: list[Any], message: str
) -> None:
    with pytest.raises(ClaimError) as e:
        plan(claim(*configs), rules)
    assert str(e.value).endswith(message) and str(e.value).startswith("device gpu-0: ")


def test_a_claim_may_ask_where_the_policy_lets_it() -> None:
    rules = replace(BURSTY, burst=replace(BURSTY.burst, from_claim=True, show_limit=True))
    p = plan(claim(vgpu_config("FromClaim", {"memoryLimit": "2x", "showMemoryLimit": True})),
             rules)  # fmt: skip
    assert p.gpu_limits()[0].burst_limit == 8 * GiB and p.show_limit


def test_partition_mode_offers_no_bursting() -> None:
    c = allocated_claim("c", results=[result("gpu", "gpu-0-slice-1")],
                        configs=[vgpu_config("FromClass", {"memoryLimit": "2x"})])  # fmt: skip
    with pytest.raises(ClaimError, match="partition mode offers no bursting; allowed: leave"):
        plan(c, mode="partition")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2x", MemoryLimit("2x", ratio=2.0)), ("1.5x", MemoryLimit("1.5x", ratio=1.5)),
     ("8Gi", MemoryLimit("8Gi", nbytes=8 * GiB)), (4096, MemoryLimit("4096", nbytes=4096))],
)  # fmt: skip
def test_memory_limit_forms(value: Any, expected: MemoryLimit) -> None:
    params = {"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", "memoryLimit": value}
    assert decode(params).memory_limit == expected


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("memoryLimit", "0.5x", "VgpuConfig: memoryLimit '0.5x' is below the request; allowed: "
         "1x or more"),
        ("memoryLimit", "2y", "VgpuConfig: memoryLimit: '2y' is not a quantity; allowed: a "
         "Kubernetes quantity"),
        ("memoryLimit", True, "VgpuConfig: memoryLimit True invalid; allowed: a Kubernetes"),
        ("memoryLimit", "0", "VgpuConfig: memoryLimit must be more than 0 bytes"),
        ("showMemoryLimit", "yes", "VgpuConfig: showMemoryLimit 'yes' invalid; allowed: true, "
         "false"),
    ],
)  # fmt: skip
def test_vgpuconfig_burst_fields_refused(field: str, value: Any, message: str) -> None:
    params = {"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", field: value}
    with pytest.raises(ConfigError) as e:
        decode(params)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)

"""driver/claims.py and driver/vgpuconfig.py on their own: limits and configs from a claim."""

from __future__ import annotations

from typing import Any

import pytest

from driver import devicenames
from driver.claims import ClaimError, ClaimRef, plan_claim
from driver.vgpuconfig import ConfigError, EffectiveConfig, VgpuConfig, decode
from tests.driver.kubelet_standin import DRIVER, allocated_claim, result, vgpu_config
from tests.driver.plugin_process import fake_gpus

GiB = 1024**3
REF = ClaimRef("default", "c", "uid-1")


def plan(claim: dict[str, Any], mode: str = "sharing", partitions: int = 4) -> Any:
    claim["metadata"]["uid"] = REF.uid
    return plan_claim(claim, REF, driver_name=DRIVER, node_name="node-a", gpus=fake_gpus(),
                      mode=mode, partitions=partitions)  # fmt: skip


def test_two_slices_of_one_gpu_add_up() -> None:
    p = plan(
        allocated_claim(
            "c",
            results=[
                result("a", "gpu-0-slice-0", share=False),
                result("b", "gpu-0-slice-2", share=False),
            ],
        ),
        mode="partition",
    )
    [g] = p.gpu_limits()
    assert (g.memory_limit, g.sm_limit) == (40 * GiB, 50)


@pytest.mark.parametrize(("cores", "percent"), [("50", 50), ("100", 100), ("30000m", 30)])
def test_cores_quantities(cores: str, percent: int) -> None:
    claim = allocated_claim("c", results=[result("gpu", "gpu-0", cores=cores)])
    assert plan(claim).gpu_limits()[0].sm_limit == percent


def test_fractional_cores_rejected() -> None:
    claim = allocated_claim("c", results=[result("gpu", "gpu-0", cores="500m")])
    with pytest.raises(ClaimError, match="cores '500m' invalid; allowed: a whole percent"):
        plan(claim)


@pytest.mark.parametrize(
    ("consumed", "message"),
    [
        ({"memory": "lots"}, "consumed memory: 'lots' is not a quantity"),
        ({"memory": "4g"}, "consumed memory: '4g' is not a quantity"),  # the shim's g
        ({"memory": "1500m"}, "consumed memory: '1500m' is 1.5 bytes, not a whole number of bytes"),
        ({"memory": "81Gi"}, "outside 1 B..80.0 GiB"),
        ({"cores": "0"}, "cores '0' invalid"),
        ({"cores": "101"}, "cores '101' invalid"),
        ({"cores": "x"}, "cores 'x' is not a number"),
        ({"memory": "Infinity"}, "consumed memory: 'Infinity' is not a quantity"),
        ({"memory": "1e400"}, "consumed memory: '1e400' is out of range"),
        # turned into an int, this one would take the plugin's memory and time
        ({"memory": "1e4000000000"}, "consumed memory: '1e4000000000' is out of range"),
        ({"cores": "Infinity"}, "cores 'Infinity' is not a number"),
        ({"cores": "1e400"}, "cores '1e400' is not a number"),
    ],
)
def test_bad_consumed_capacity(consumed: dict[str, str], message: str) -> None:
    r = result("gpu", "gpu-0")
    r["consumedCapacity"] = consumed
    with pytest.raises(ClaimError, match=message.replace("(", r"\(").replace(".", r"\.")):
        plan(allocated_claim("c", results=[r]))


# The canonical forms the API server emits, read with Kubernetes' rules (k, M, G are powers of
# 1000; the shim's HAMi-style k = 1024 would read 33554432k as 32 GiB).
KUBE_QUANTITIES = [
    ("1500k", 1_500_000),
    ("4G", 4_000_000_000),
    ("1e9", 1_000_000_000),
    ("4Gi", 4 * GiB),
    ("33554432k", 33_554_432_000),
]


@pytest.mark.parametrize(("quantity", "expected"), KUBE_QUANTITIES)
def test_consumed_memory_is_a_kubernetes_quantity(quantity: str, expected: int) -> None:
    claim = allocated_claim("c", results=[result("gpu", "gpu-0", memory=quantity)])
    assert plan(claim).gpu_limits()[0].memory_limit == expected


@pytest.mark.parametrize(("quantity", "expected"), KUBE_QUANTITIES)
def test_memory_limit_override_is_a_kubernetes_quantity(quantity: str, expected: int) -> None:
    claim = allocated_claim(
        "c",
        results=[result("gpu", "gpu-0", memory="40Gi")],
        configs=[vgpu_config("FromClaim", {"memoryLimitOverride": quantity})],
    )
    assert plan(claim).gpu_limits()[0].memory_limit == expected


def test_hostname_expression_selector_and_no_selector() -> None:
    claim = allocated_claim("c", node=None)
    claim["status"]["allocation"]["nodeSelector"] = {
        "nodeSelectorTerms": [
            {
                "matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-b"]}
                ]
            }
        ]
    }
    with pytest.raises(ClaimError, match="allocated for node node-b"):
        plan(claim)
    assert plan(allocated_claim("c", node=None)).devices  # no selector: not pinned, accepted


def test_subrequest_matches_parent_request_config() -> None:
    claim = allocated_claim(
        "c",
        results=[result("gpu/small", "gpu-0", memory="4Gi")],
        configs=[vgpu_config("FromClaim", {"memoryLimitOverride": "3Gi"}, requests=["gpu"])],
    )
    assert plan(claim).gpu_limits()[0].memory_limit == 3 * GiB


def test_conflicting_policies_between_requests() -> None:
    claim = allocated_claim(
        "c",
        results=[result("a", "gpu-0"), result("b", "gpu-1")],
        configs=[vgpu_config("FromClaim", {"computePolicy": "elastic"}, requests=["a"])],
    )
    with pytest.raises(ClaimError, match="differ between its requests"):
        plan(claim)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("not an object", "parameters must be an object, got str"),
        ({"apiVersion": "vgpu.sharing.dev/v1", "kind": "VgpuConfig"}, "apiVersion 'vgpu.sharing.dev/v1' unsupported"),
        ({"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "GpuConfig"}, "kind 'GpuConfig' unsupported"),
        ({"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", "priority": True}, "priority True invalid"),
        ({"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", "priority": 1.5}, "priority 1.5 invalid"),
        ({"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", "memoryLimitOverride": "0"}, "more than 0 bytes"),
        ({"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", "memoryLimitOverride": "1.5x"}, "'1.5x' is not a quantity"),
        ({"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", "memoryLimitOverride": "512m"}, "'512m' is 0.512 bytes, not a whole number of bytes"),
        ({"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", "memoryLimitOverride": [1]}, "memoryLimitOverride [1] invalid"),
        ({"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", "memoryLimitOverride": "Infinity"}, "'Infinity' is not a quantity"),
        ({"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig", "memoryLimitOverride": "1e400"}, "'1e400' is out of range"),
    ],
)  # fmt: skip
def test_vgpuconfig_rejects(params: Any, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        decode(params)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_vgpuconfig_merge_field_by_field() -> None:
    base = decode({"apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "VgpuConfig",
                   "computePolicy": "off", "priority": 0, "memoryLimitOverride": 1024})  # fmt: skip
    later = VgpuConfig(priority=-5)
    assert EffectiveConfig.of([base, later]) == EffectiveConfig("off", -5, 1024)
    assert EffectiveConfig.of([]) == EffectiveConfig("hard", 1, None)


@pytest.mark.parametrize("mode", ["sharing", "partition"])
def test_published_device_names_read_back(mode: str) -> None:
    """What the publishing side names a device is what the prepare side reads (one module)."""
    for index in (0, 7, 12):
        for k, name in enumerate(devicenames.names(index, mode, 3)):
            parsed = devicenames.parse(name, mode)
            assert parsed == devicenames.DeviceName(index, k if mode == "partition" else None)


@pytest.mark.parametrize(
    ("device", "mode", "message"),
    [
        ("gpu-0-slice-1", "sharing", "sharing mode; allowed: gpu-<index>"),
        ("gpu-0", "partition", "partition mode; allowed: gpu-<index>-slice-<k>"),
        ("gpu-01", "sharing", "sharing mode; allowed: gpu-<index>"),
        ("gpu-0-slice-4", "partition", "with k in 0..3"),
        ("gpu-9", "sharing", "no GPU with index 9 on this node"),
    ],
)
def test_device_names_not_of_this_node_are_refused(device: str, mode: str, message: str) -> None:
    claim = allocated_claim("c", results=[result("gpu", device, share=False)])
    with pytest.raises(ClaimError) as e:
        plan(claim, mode=mode)
    assert message in str(e.value) and "\n" not in str(e.value)

"""A MIG-enabled GPU is not offered for sharing: discovery leaves it out like an unhealthy GPU
(one warning saying why and what to do), the slices do not carry it, and a claim on it fails
prepare with a clear error. The simulated GPU has no MIG: NVML's error means "not MIG"."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from driver.claims import ClaimError, ClaimRef, plan_claim
from driver.discovery import MIG_REASON, Discovery
from driver.slicebuild import build_devices, health_map
from sharing.gpus import GpuInfo, list_gpus, use_simulator
from tests.fakes.nvml import FakeNvml
from tests.support.gpu_records import a100


def test_mig_gpu_is_left_out_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    gpus = [a100(0), replace(a100(1), mig_enabled=True)]
    d = Discovery(FakeNvml(gpus), sysfs_root=Path("/nonexistent"))
    caplog.set_level(logging.WARNING)
    inv = d.inventory(gpus, {})
    d.inventory(gpus, {})
    assert [(g.index, g.healthy, g.reason) for g in inv.gpus] == [
        (0, True, ""),
        (1, False, MIG_REASON),
    ]
    assert caplog.text.count("MIG mode is enabled; not offered") == 1
    assert "nvidia-smi -i 1 -mig 0" in caplog.text
    assert [dev["name"] for dev in build_devices(inv.gpus, "sharing", 4)] == ["gpu-0"]
    assert health_map(inv, "sharing", 4) == {"gpu-0": "", "gpu-1": MIG_REASON}
    # never offered, not even tainted where the server keeps taints
    tainted = build_devices(inv.gpus, "sharing", 4, taint="vgpu.sharing.dev/unhealthy")
    assert [dev["name"] for dev in tainted] == ["gpu-0"]


def test_claim_on_a_mig_gpu_fails_prepare() -> None:
    mig: GpuInfo = replace(a100(0), mig_enabled=True)
    claim = {
        "metadata": {"uid": "u", "name": "c", "namespace": "ns"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "d.example.com",
                            "pool": "n",
                            "device": "gpu-0",
                        }
                    ]
                }
            }
        },
    }
    with pytest.raises(ClaimError, match=r"MIG mode enabled; MIG is not supported yet"):
        plan_claim(
            claim,
            ClaimRef("ns", "c", "u"),
            driver_name="d.example.com",
            node_name="n",
            gpus=[mig],
            mode="sharing",
            partitions=4,
        )


def test_the_simulator_is_not_mig() -> None:
    try:
        use_simulator()
        gpus = list_gpus()
    except Exception as e:  # the simulator not built
        pytest.skip(f"simulated NVML unavailable: {e}")
    assert gpus and not any(g.mig_enabled for g in gpus)

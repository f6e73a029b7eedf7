"""`vgpu-kubelet-plugin --dry-run` on the simulated GPU, its slices fed to `vgpu plan`.

Both console scripts run as real processes: the plugin loads the simulator's
libnvidia-ml.so.1 through LD_LIBRARY_PATH, as on a node, and talks to no API server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.sharing.plan.build import CLASS, request, workload

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[3]


def _sim_device(i: int, memory: str, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "uuid": f"GPU-d7700000-0000-0000-0000-00000000000{i}",
        "memory": memory,
        "sm_count": 108,
        "pci_bus_id": f"00000000:{0x40 + i:02X}:00.0",
        "numa_node": 0,
        "compute_capability": "8.0",
        "healthy": True,
        "minor": i,
    }


@pytest.fixture
def sim_env(sim_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """Two A100s on a 550 driver, and no cluster: the dry run must not need one."""
    config = tmp_path / "simgpu.json"
    config.write_text(
        json.dumps(
            {
                "devices": [
                    _sim_device(0, "40Gi", "NVIDIA A100-SXM4-40GB"),
                    _sim_device(1, "40Gi", "NVIDIA A100-SXM4-40GB"),
                ],
                "driver_version": "550.54.15",
                "cuda_version": "12.4",
            }
        )
    )
    env = {k: v for k, v in sim_env.items() if k != "KUBECONFIG"}
    env["SIMGPU_CONFIG"] = str(config)
    return env


def dry_run(env: dict[str, str], node: str, *flags: str) -> str:
    r = subprocess.run(
        [str(BIN / "vgpu-kubelet-plugin"), "--dry-run", "--node-name", node, *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def plan(slices: Path, workloads: Path) -> tuple[int, dict[str, Any], str]:
    r = subprocess.run(
        [
            str(BIN / "vgpu"),
            "plan",
            "--slices",
            str(slices),
            "--workloads",
            str(workloads),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.returncode, json.loads(r.stdout) if r.stdout else {}, r.stderr


def test_dry_run_prints_the_slices_the_plugin_would_publish(sim_env: dict[str, str]) -> None:
    doc = yaml.safe_load(dry_run(sim_env, "gpu-node-7"))
    assert doc["kind"] == "List"
    [s] = doc["items"]
    assert s["kind"] == "ResourceSlice" and s["apiVersion"] == "resource.k8s.io/v1"
    assert s["spec"]["nodeName"] == "gpu-node-7"
    assert s["spec"]["pool"] == {"name": "gpu-node-7", "generation": 1, "resourceSliceCount": 1}
    devs = s["spec"]["devices"]
    assert [d["name"] for d in devs] == ["gpu-0", "gpu-1"]
    assert devs[0]["allowMultipleAllocations"] is True
    assert devs[0]["capacity"]["memory"]["value"] == "40Gi"
    assert devs[0]["attributes"]["productName"] == {"string": "NVIDIA A100-SXM4-40GB"}


def test_dry_run_without_nvml_fails_with_one_message(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    r = subprocess.run(
        [str(BIN / "vgpu-kubelet-plugin"), "--dry-run", "--node-name", "n"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode == 0:
        pytest.skip("this machine has a real NVML")
    assert r.returncode == 1
    assert "NVML: cannot list GPUs" in r.stderr
    assert r.stdout == ""


def test_plan_on_two_dry_run_nodes_sharing_and_partition(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    slices = tmp_path / "slices"
    slices.mkdir()
    (slices / "a-sharing.yaml").write_text(dry_run(sim_env, "node-a"))
    (slices / "b-partition.yaml").write_text(
        dry_run(sim_env, "node-b", "--sharing-mode", "partition", "--partitions", "4")
    )
    (slices / "class.yaml").write_text(yaml.safe_dump(CLASS))
    workloads = tmp_path / "w.yaml"
    # node-a: 2 x 40Gi shared GPUs, memory rounded up to 256Mi steps: 9000Mi -> 9216Mi (36
    # steps), 4 per GPU (36864Mi; a fifth needs 46080Mi > 40960Mi), so 8 on node-a.
    # node-b: 2 GPUs x 4 partitions of 10Gi/25 cores: 8 more, each partition taken whole.
    workloads.write_text(
        yaml.safe_dump(
            {
                "workloads": [
                    workload("infer", 17, [request(capacity={"memory": "9000Mi", "cores": "20"})])
                ]
            }
        )
    )
    code, doc, err = plan(slices, workloads)
    assert code == 1, err
    where = [(p["node"], p["device"], p["consumed"]["memory"]) for p in doc["placed"]]
    assert where[:8] == [("node-a", "gpu-0", "9Gi")] * 4 + [("node-a", "gpu-1", "9Gi")] * 4
    assert where[8:] == [
        ("node-b", f"gpu-{g}-slice-{k}", "10Gi") for g in range(2) for k in range(4)
    ]
    assert [u["replica"] for u in doc["unplaced"]] == [16]
    free = {(d["node"], d["device"]): d["free"] for d in doc["devices"]}
    assert free[("node-a", "gpu-0")] == {
        "cores": "20",
        "memory": "4Gi",
        "sharers": "12",
    }  # 16 sharers (policy default)
    assert free[("node-b", "gpu-1-slice-3")] == {"cores": "0", "memory": "0"}


def test_dry_run_flag_and_its_environment_twin() -> None:
    from driver.flags import SettingsError, parse

    assert parse(["--node-name", "n"], env={}).dry_run is False
    assert parse(["--node-name", "n", "--dry-run"], env={}).dry_run is True
    assert parse(["--node-name", "n"], env={"DRY_RUN": "true"}).dry_run is True
    with pytest.raises(SettingsError, match="--dry-run: 'maybe' is not a boolean"):
        parse(["--node-name", "n", "--dry-run=maybe"], env={})


def test_dry_run_publishes_what_the_admin_policy_says(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    """`--dry-run --policy FILE`: the slices an admin plans with are the ones the policy shapes
    (reserved memory held back, its request policies, its sharers), and `vgpu plan` follows."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "apiVersion: vgpu.sharing.dev/v1alpha1\n"
        "kind: SharingPolicy\n"
        "default:\n"
        "  reservedMemory: 8Gi\n"
        "  memory: {min: 2Gi, step: 2Gi, default: 4Gi}\n"
        "  cores: {min: 10, step: 10, default: 20}\n"
        "  maxSharers: 3\n"
    )
    doc = yaml.safe_load(
        dry_run(sim_env, "node-p", "--sharing-mode", "sharing", "--policy", str(policy))
    )
    dev = doc["items"][0]["spec"]["devices"][0]
    mem, cores, sharers = (dev["capacity"][k] for k in ("memory", "cores", "sharers"))
    assert mem["value"] == "32Gi"  # 40Gi less the 8Gi held back
    assert mem["requestPolicy"] == {
        "default": "4Gi",
        "validRange": {"min": "2Gi", "max": "32Gi", "step": "2Gi"},
    }
    assert cores["requestPolicy"]["default"] == "20"
    assert sharers["value"] == "3"
    slices = tmp_path / "slices.yaml"
    slices.write_text(yaml.safe_dump(doc))
    workloads = tmp_path / "workloads.yaml"
    workloads.write_text(
        yaml.safe_dump({"workloads": [workload("small", 8, [request()])], "deviceClasses": [CLASS]})
    )
    code, out, err = plan(slices, workloads)
    # Each GPU takes three (its sharers) of the default 4Gi/20-core shares: 6 of 8 fit.
    assert code == 1, err
    assert len(out["placed"]) == 6 and [u["replica"] for u in out["unplaced"]] == [6, 7]
    assert out["placed"][0]["consumed"] == {"cores": "20", "memory": "4Gi", "sharers": "1"}
    # A bad policy file: exit 2, one line naming the field.
    policy.write_text(
        "apiVersion: vgpu.sharing.dev/v1alpha1\nkind: SharingPolicy\ndefault: {maxSharers: 0}\n"
    )
    r = subprocess.run(
        [str(BIN / "vgpu-kubelet-plugin"), "--dry-run", "--node-name", "n", "--policy", str(policy)],
        env=sim_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "maxSharers" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_dry_run_takes_the_shipped_configmap_by_a_relative_path(sim_env: dict[str, str]) -> None:
    """The README's `--dry-run --policy deploy/base/policy.yaml` from a checkout: a relative path,
    and the ConfigMap `kubectl apply` takes, read through its data.policy.yaml."""
    r = subprocess.run(
        [str(BIN / "vgpu-kubelet-plugin"), "--dry-run", "--node-name", "n", "--sharing-mode",
         "sharing", "--policy", "deploy/base/policy.yaml"],
        env=sim_env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    shipped = yaml.safe_load((REPO / "deploy/base/policy.yaml").read_text())
    policy = yaml.safe_load(shipped["data"]["policy.yaml"])
    dev = yaml.safe_load(r.stdout)["items"][0]["spec"]["devices"][0]
    assert (
        dev["capacity"]["memory"]["requestPolicy"]["default"]
        == (policy["default"]["memory"]["default"])
    )


def test_a_reservation_larger_than_the_gpu_is_said_not_silent(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "apiVersion: vgpu.sharing.dev/v1alpha1\nkind: SharingPolicy\n"
        "default: {reservedMemory: 100Gi}\n"
    )
    r = subprocess.run(
        [str(BIN / "vgpu-kubelet-plugin"), "--dry-run", "--node-name", "n", "--sharing-mode",
         "sharing", "--policy", str(policy)],
        env=sim_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    [empty] = yaml.safe_load(r.stdout)["items"]  # the pool is published, with no device
    assert empty["spec"]["devices"] == []
    lines = [x for x in r.stderr.splitlines() if "leaves nothing to offer" in x]
    assert len(lines) == 2, r.stderr  # one line for each of the two GPUs, none twice
    assert "GPU 0 (GPU-" in lines[0] and f"reservedMemory {100 << 30}" in lines[0], lines

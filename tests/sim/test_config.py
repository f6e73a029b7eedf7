"""SIMGPU_CONFIG: devices, defaults, quantities, and clear one-line errors for bad files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.sim.simhelp import CONTEXT_MEMORY, run_python, write_config

BAD = [
    # (file content, field named in the message, words of what is allowed)
    ('{"devices": [{"name": "x",}]}', "(document)", "JSON object"),
    ('{"devices": [{"memory": "80Gx"}]}', "devices[0].memory", "Ki, Mi, Gi, Ti"),
    ('{"devices": [{"memory": -5}]}', "devices[0].memory", "bytes as an integer"),
    ('{"devices": [{}, {"sm_count": "132"}]}', "devices[1].sm_count", "integer from 1 to 1024"),
    ('{"devices": [{"smcount": 10}]}', "devices[0].smcount", "name, uuid, memory"),
    ('{"devices": [{"uuid": "GPU-123"}]}', "devices[0].uuid", "8-4-4-4-12"),
    (
        '{"devices": [{"pci_bus_id": "zz:00.0"}]}',
        "devices[0].pci_bus_id",
        "domain:bus:device.function",
    ),
    ('{"devices": [{"compute_capability": 9.0}]}', "devices[0].compute_capability", "major.minor"),
    ('{"devices": [{"healthy": "no"}]}', "devices[0].healthy", "true or false"),
    ('{"devices": {}}', "devices", "array of 0 to 128"),
    ('{"devices": [{}], "cuda": "12.4"}', "cuda", "devices, driver_version, cuda_version"),
    ('{"cuda_version": "twelve"}', "cuda_version", "major.minor"),
    ("[1, 2]", "(document)", "an object"),
    (
        '{"devices": [{"uuid": "GPU-00000000-0000-0000-0000-000000000001"}, '
        '{"uuid": "GPU-00000000-0000-0000-0000-000000000001"}]}',
        "devices[1].uuid",
        "unique",
    ),
    ("", "(document)", "JSON object"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("content", "field", "allowed"), BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)]
)
def test_bad_config_is_one_clear_line(
    sim_tool: Path, sim_env: dict[str, str], tmp_path: Path, content: str, field: str, allowed: str
) -> None:
    path = write_config(tmp_path, content)
    env = {**sim_env, "SIMGPU_CONFIG": str(path)}
    r = subprocess.run([str(sim_tool), "init"], env=env, capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() != "0", "cuInit must fail"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert str(path) in line and field in line and "allowed:" in line and allowed in line, line
    # NVML fails the same way, with the same line
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pynvml as nv\ntry:\n    nv.nvmlInit()\nexcept nv.NVMLError as e:\n    print('FAILED', e)",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "FAILED" in probe.stdout, probe.stdout + probe.stderr
    assert probe.stderr.strip().splitlines() == [line]


def test_missing_file(sim_tool: Path, sim_env: dict[str, str], tmp_path: Path) -> None:
    env = {**sim_env, "SIMGPU_CONFIG": str(tmp_path / "nope.json")}
    r = subprocess.run([str(sim_tool), "init"], env=env, capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() != "0"
    assert "nope.json" in r.stderr and "No such file" in r.stderr and "allowed:" in r.stderr


def test_devices_quantities_and_defaults(
    sim_tool: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    path = write_config(
        tmp_path,
        {
            "devices": [
                {
                    "name": "NVIDIA A100-SXM4-40GB",
                    "memory": "40Gi",
                    "sm_count": 108,
                    "compute_capability": "8.0",
                    "pci_bus_id": "0000:3b:00.0",
                    "numa_node": 1,
                },
                {"memory": 1000000000},
                {"memory": "1.5G", "minor": 7, "numa_node": -1},
            ],
            "driver_version": "550.54.15",
            "cuda_version": "12.4",
        },
    )
    env = {**sim_env, "SIMGPU_CONFIG": str(path)}
    got = run_python(
        env,
        """
nv.nvmlInit()
out = {"driver": text(nv.nvmlSystemGetDriverVersion()), "cuda": nv.nvmlSystemGetCudaDriverVersion(), "devs": []}
for i in range(nv.nvmlDeviceGetCount()):
    h = nv.nvmlDeviceGetHandleByIndex(i)
    try:
        numa = nv.nvmlDeviceGetNumaNodeId(h)
    except nv.NVMLError:
        numa = None
    out["devs"].append({
        "name": text(nv.nvmlDeviceGetName(h)), "uuid": text(nv.nvmlDeviceGetUUID(h)),
        "total": nv.nvmlDeviceGetMemoryInfo(h).total, "bus": text(nv.nvmlDeviceGetPciInfo(h).busId),
        "cc": list(nv.nvmlDeviceGetCudaComputeCapability(h)), "minor": nv.nvmlDeviceGetMinorNumber(h), "numa": numa})
print(json.dumps(out))
""",
    )
    assert got["driver"] == "550.54.15" and got["cuda"] == 12040
    d1, d2, d0 = got["devs"]  # NVML enumerates in PCI bus order (0x19, 0x1A, 0x3B), not file order
    assert d0 == {
        "name": "NVIDIA A100-SXM4-40GB",
        "uuid": d0["uuid"],
        "total": 40 << 30,
        "bus": "00000000:3B:00.0",
        "cc": [8, 0],
        "minor": 0,
        "numa": 1,
    }
    assert d1["total"] == 10**9 and d2["total"] == 1_500_000_000
    assert d1["name"] == "NVIDIA H100 80GB HBM3" and d1["cc"] == [9, 0]
    assert len({d0["uuid"], d1["uuid"], d2["uuid"]}) == 3  # defaults derived from the index
    assert d1["bus"] == "00000000:19:00.0" and d2["bus"] == "00000000:1A:00.0"
    assert (d1["minor"], d2["minor"]) == (1, 7)
    assert d2["numa"] is None
    # CUDA sees the same devices
    # (ordinal 0 is the fastest device, an H100: name the A100 by its UUID)
    env["CUDA_VISIBLE_DEVICES"] = d0["uuid"]
    r = subprocess.run(
        [str(sim_tool), "info"], env=env, capture_output=True, text=True, timeout=30, check=True
    )
    assert f"total={40 << 30}" in r.stdout


def test_config_reread_at_every_init(sim_env: dict[str, str], tmp_path: Path) -> None:
    path = write_config(tmp_path, {"devices": [{}]})
    env = {**sim_env, "SIMGPU_CONFIG": str(path)}
    got = run_python(
        env,
        f"""
import pathlib
nv.nvmlInit(); a = nv.nvmlDeviceGetCount(); nv.nvmlShutdown()
pathlib.Path({str(path)!r}).write_text(json.dumps({{"devices": [{{}}, {{}}, {{}}]}}))
nv.nvmlInit(); b = nv.nvmlDeviceGetCount(); nv.nvmlShutdown()
print(json.dumps([a, b]))
""",
    )
    assert got == [1, 3]


@pytest.mark.parametrize(
    ("visible", "ordinal0_total"),
    [
        ("1", 2 << 30),
        ("2,0", 3 << 30),
        ("2,bogus,0", 3 << 30),
        ("GPU-5a1d0c0e-1001", 2 << 30),
        ("0,0,1", 1 << 30),
    ],
)
def test_cuda_visible_devices(
    sim_tool: Path, sim_env: dict[str, str], tmp_path: Path, visible: str, ordinal0_total: int
) -> None:
    """CUDA ordinals number the visible devices (real driver rules: indices or UUID prefixes, the
    list ends at the first invalid or repeated entry)."""
    cfg = write_config(
        tmp_path, {"devices": [{"memory": "1Gi"}, {"memory": "2Gi"}, {"memory": "3Gi"}]}
    )
    env = {**sim_env, "SIMGPU_CONFIG": str(cfg), "CUDA_VISIBLE_DEVICES": visible}
    r = subprocess.run(
        [str(sim_tool), "info"], env=env, capture_output=True, text=True, timeout=30, check=True
    )
    assert f"total={ordinal0_total}" in r.stdout


def test_visible_device_memory_is_charged_to_the_physical_device(
    sim_tool: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    from tests.sim.simhelp import Client

    cfg = write_config(tmp_path, {"devices": [{"memory": "1Gi"}, {"memory": "2Gi"}]})
    env = {**sim_env, "SIMGPU_CONFIG": str(cfg)}
    holder = Client(sim_tool, {**env, "CUDA_VISIBLE_DEVICES": "1"}, "hold", str(100 << 20))
    try:
        used = run_python(
            env,
            """
nv.nvmlInit()
print(json.dumps([nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).used for i in range(2)]))
""",
        )
        assert used == [0, (100 << 20) + CONTEXT_MEMORY]  # its allocation and its context
    finally:
        holder.finish()
    r = subprocess.run(
        [str(sim_tool), "init"],
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.stdout.strip() == "100"  # CUDA_ERROR_NO_DEVICE: nothing visible

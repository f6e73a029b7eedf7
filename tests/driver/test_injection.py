"""CDI without the NVIDIA runtime (driver/injection.py), on a fake driver root: the toolkit's
spec when it covers the claim's GPUs, else the driver's libraries (by the version the driver
reports, with their soname links), tools and control device nodes, NVIDIA_VISIBLE_DEVICES=void;
nothing (and one warning) where no driver is found."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest

from cdi.spec import ContainerEdits, DeviceNode, Mount
from driver.injection import (
    DriverInjector,
    DriverRoot,
    Injection,
    apply,
    driver_libraries,
    find_nvml,
)
from tests.driver.plugin_process import fake_gpus

VERSION = "550.54.15"
ARCH = "usr/lib/x86_64-linux-gnu"


def fake_driver_root(root: Path, version: str = VERSION) -> Path:
    lib = root / ARCH
    lib.mkdir(parents=True)
    for name in ("libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm"):
        (lib / f"{name}.so.{version}").write_bytes(b"\x7fELF")
    os.symlink(f"libcuda.so.{version}", lib / "libcuda.so.1")
    os.symlink("libcuda.so.1", lib / "libcuda.so")  # the development link: not mounted
    os.symlink(f"libnvidia-ml.so.{version}", lib / "libnvidia-ml.so.1")
    os.symlink(f"libnvidia-nvvm.so.{version}", lib / "libnvidia-nvvm.so.4")
    (lib / "libnvidia-ml.so.470.1").write_bytes(b"old")  # another driver's leftover
    (lib / "libc.so.6").write_bytes(b"not ours")
    i386 = root / "usr/lib/i386-linux-gnu"  # 32-bit libraries are not for 64-bit containers
    i386.mkdir(parents=True)
    (i386 / f"libcuda.so.{version}").write_bytes(b"32")
    (root / "usr/bin").mkdir(parents=True)
    for tool in ("nvidia-smi", "nvidia-debugdump", "bash"):
        (root / "usr/bin" / tool).write_text("#!/bin/sh\n")
        (root / "usr/bin" / tool).chmod(0o755)
    (root / "usr/bin/nvidia-notes.txt").write_text("not executable")
    return root


def fake_dev(dev: Path) -> Path:
    dev.mkdir()
    for n in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "null"):
        (dev / n).touch()
    (dev / "nvidia-caps").mkdir()
    (dev / "nvidia-caps" / "nvidia-cap1").touch()
    return dev


def test_libraries_are_discovered_by_the_driver_version(tmp_path: Path) -> None:
    root = DriverRoot(Path("/run/nvidia/driver"), fake_driver_root(tmp_path / "root"))
    libs = dict(driver_libraries(root, VERSION))
    assert libs == {
        f"{ARCH}/libcuda.so.{VERSION}": [f"libcuda.so.{VERSION}", "libcuda.so.1"],
        f"{ARCH}/libnvidia-ml.so.{VERSION}": [f"libnvidia-ml.so.{VERSION}", "libnvidia-ml.so.1"],
        f"{ARCH}/libnvidia-nvvm.so.{VERSION}": [
            f"libnvidia-nvvm.so.{VERSION}",
            "libnvidia-nvvm.so.4",
        ],
        f"{ARCH}/libnvidia-ptxjitcompiler.so.{VERSION}": [f"libnvidia-ptxjitcompiler.so.{VERSION}"],
    }
    assert driver_libraries(root, "999.1") == []
    assert find_nvml(root) == root.mount / ARCH / "libnvidia-ml.so.1"


def test_ours_when_no_toolkit_spec(tmp_path: Path) -> None:
    mount = fake_driver_root(tmp_path / "root")
    dev = fake_dev(tmp_path / "dev")
    injector = DriverInjector(DriverRoot(Path("/run/nvidia/driver"), mount), [tmp_path], dev)
    gpus = [replace(g, driver_version=VERSION) for g in fake_gpus(1)]
    inj = injector.for_gpus(gpus)
    assert inj.source == "driver-root" and inj.cdi_ids == ()
    assert inj.env == (("NVIDIA_VISIBLE_DEVICES", "void"),)
    mounts = {m.container_path: m.host_path for m in inj.mounts}
    host = f"/run/nvidia/driver/{ARCH}"
    assert mounts[f"/{ARCH}/libcuda.so.1"] == f"{host}/libcuda.so.{VERSION}"
    assert mounts[f"/{ARCH}/libcuda.so.{VERSION}"] == f"{host}/libcuda.so.{VERSION}"
    assert mounts[f"/{ARCH}/libnvidia-ml.so.1"] == f"{host}/libnvidia-ml.so.{VERSION}"
    assert mounts["/usr/bin/nvidia-smi"] == "/run/nvidia/driver/usr/bin/nvidia-smi"
    assert "/usr/bin/nvidia-debugdump" in mounts
    assert not {"/usr/bin/bash", "/usr/bin/nvidia-notes.txt", f"/{ARCH}/libcuda.so"} & set(mounts)
    assert not any("i386" in p or "470" in p for p in mounts.values())
    assert all(m.options == ("ro", "nosuid", "nodev", "bind") for m in inj.mounts)
    # Control nodes only: the GPUs' own nodes are the claim's (driver/claimspec.py adds them).
    assert sorted(n.path for n in inj.device_nodes) == [
        "/dev/nvidia-caps/nvidia-cap1",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidiactl",
    ]


def toolkit_spec(d: Path, names: list[str]) -> None:
    d.mkdir(exist_ok=True)
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [{"name": n, "containerEdits": {}} for n in names],
    }
    (d / "nvidia.yaml").write_text(json.dumps(spec))


def test_the_toolkit_spec_wins_when_it_covers_every_gpu(tmp_path: Path) -> None:
    mount = fake_driver_root(tmp_path / "root")
    gpus = fake_gpus(2)
    cdi = tmp_path / "cdi"
    toolkit_spec(cdi, [gpus[0].uuid, gpus[1].uuid, "all"])
    (cdi / "other.json").write_text(json.dumps({"kind": "example.com/nic", "devices": []}))
    (cdi / "broken.yaml").write_text(": not yaml [")
    injector = DriverInjector(DriverRoot(Path("/"), mount), [tmp_path / "absent", cdi])
    inj = injector.for_gpus(gpus)
    assert inj == Injection(
        cdi_ids=(f"nvidia.com/gpu={gpus[0].uuid}", f"nvidia.com/gpu={gpus[1].uuid}"),
        source="toolkit",
    )
    # Index-named devices (the toolkit's other naming strategy) are found too.
    toolkit_spec(cdi, ["0", "1"])
    assert injector.for_gpus(gpus[1:]).cdi_ids == ("nvidia.com/gpu=1",)
    # A GPU the spec does not cover: the driver root instead, for the whole claim.
    toolkit_spec(cdi, [gpus[0].uuid])
    assert injector.for_gpus([replace(g, driver_version=VERSION) for g in gpus]).source == (
        "driver-root"
    )


def test_nothing_and_one_warning_without_a_driver(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    injector = DriverInjector(DriverRoot(Path("/"), tmp_path), [tmp_path])
    caplog.set_level(logging.WARNING)
    assert injector.for_gpus(fake_gpus(1)) == Injection()
    assert injector.for_gpus(fake_gpus(1)) == Injection()
    assert caplog.text.count("no NVIDIA driver libraries") == 1
    assert DriverInjector(None, []).for_gpus(fake_gpus(1)) == Injection()


def test_apply_overrides_env_and_adds_without_duplicates() -> None:
    edits = ContainerEdits(
        env=(("CUDA_VISIBLE_DEVICES", "GPU-1"), ("NVIDIA_VISIBLE_DEVICES", "GPU-1")),
        device_nodes=(DeviceNode("/dev/nvidiactl", "/dev/nvidiactl"),),
        mounts=(Mount("/a", "/a"),),
    )
    inj = Injection(
        env=(("NVIDIA_VISIBLE_DEVICES", "void"),),
        mounts=(Mount("/b", "/b"),),
        device_nodes=(
            DeviceNode("/dev/nvidiactl", "/dev/nvidiactl"),
            DeviceNode("/dev/nvidia-uvm", "/dev/nvidia-uvm"),
        ),
    )
    out = apply(edits, inj)
    assert out.env == (("CUDA_VISIBLE_DEVICES", "GPU-1"), ("NVIDIA_VISIBLE_DEVICES", "void"))
    assert [m.container_path for m in out.mounts] == ["/a", "/b"]
    assert [n.path for n in out.device_nodes] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert apply(edits, Injection()) is edits


@pytest.mark.slow
def test_the_plugin_loads_nvml_from_the_driver_root_mount(tmp_path: Path) -> None:
    """As in the DaemonSet: no NVML on the process's library path, the driver root mounted at
    DRIVER_ROOT_MOUNT; pynvml then works with the driver root's libnvidia-ml.so.1 (here the
    simulator's, laid out as an installed driver)."""
    import subprocess
    import sys

    from sharing.paths import ArtefactMissingError, sim_lib_dir

    try:
        sim = sim_lib_dir()
    except ArtefactMissingError as e:
        pytest.skip(str(e))
    lib = tmp_path / ARCH
    lib.mkdir(parents=True)
    (lib / "libnvidia-ml.so.570.172.08").write_bytes((sim / "libnvidia-ml.so.1").read_bytes())
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.570.172.08")
    code = (
        "import sys; from pathlib import Path; import pynvml;"
        "from driver.injection import DriverRoot, load_driver_nvml;"
        "print(load_driver_nvml(DriverRoot(Path('/'), Path(sys.argv[1]))));"
        "pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    env["SIMGPU_STATE"] = str(tmp_path)
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    loaded, count = r.stdout.split()
    assert loaded == str(lib / "libnvidia-ml.so.1") and int(count) >= 1
    # Without the driver root there is no NVML here at all: the load is what made it work.
    bare = subprocess.run(
        [sys.executable, "-c", "import pynvml; pynvml.nvmlInit()"], env=env, capture_output=True
    )
    assert bare.returncode != 0

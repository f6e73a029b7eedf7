"""The watchdog end to end with podman + runc: the plugin prepares a claim, podman starts a
container from its CDI spec (the shim preloaded through /etc/ld.so.preload), and inside it a real
program bypasses the shim (tests/c/bypass_copy.c: a renamed copy of libcuda loaded, a driver
instance the shim never hooked) and takes more than the claim's quota. `vgpu exporter --enforce kill` on the
host attributes the container's process to the claim through /proc/<pid>/root and its
environment, counts the violation on the claim's series and stops the process.

The container has its own PID namespace, as a pod's does: the simulated driver reports host PIDs
to NVML, as the kernel driver does.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from sharing.paths import sim_lib_dir
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer
from tests.support.observers import ExporterProcess, only, scrape
from tests.support.podman_containers import Podman, bypass_in_rootfs, missing_cuda, rootfs, world

__all__ = ["bypass_in_rootfs", "rootfs", "world"]  # fixtures used by name
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
GiB = 1 << 30


def test_container_bypassing_the_shim_is_caught_and_stopped(
    world: tuple[FakeApiServer, KubeletStandin, Path, Podman], bypass_in_rootfs: str
) -> None:
    if why := missing_cuda():
        pytest.skip(why)
    server, kubelet, root, podman = world
    c = claim_id(server.put(allocated_claim("escapee", namespace="team-x",
                                            results=[result("gpu", "gpu-0", memory="1Gi")])))  # fmt: skip
    [cdi_id] = kubelet.prepare([c])[c.uid].devices[0].cdi_device_ids
    env = dict(os.environ, SIMGPU_STATE=str(podman.sim_state), LD_LIBRARY_PATH=str(sim_lib_dir()))
    env.pop("SIMGPU_CONFIG", None)
    exp = ExporterProcess(["--sim", "--data-dir", str(root / "data"), "--enforce", "kill"], env)
    try:
        cmd = podman.command(cdi_id, str(2 * GiB), program=bypass_in_rootfs)
        assert "--pid" not in " ".join(cmd)
        box = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert box.stdout is not None
        line = box.stdout.readline()
        assert line.strip() == "held rc=0", (line, box.stderr.read() if box.stderr else "")
        deadline = time.monotonic() + 30
        found: list[float] = []
        while time.monotonic() < deadline:
            found = [s.value for s in only(scrape(exp.url), "vgpu_slice_quota_violations_total",
                                           claim_uid=c.uid, namespace="team-x", claim="escapee")]  # fmt: skip
            if found == [1.0]:
                break
            time.sleep(0.3)
        assert found == [1.0], found
        box.wait(30)  # SIGTERM from the watchdog ends the program, and the container with it
        assert box.returncode != 0
    finally:
        log = exp.stop()
    assert "claim team-x/escapee" in log and "over its quota" in log, log
    assert "stopping pids" in log
    assert kubelet.unprepare([c]) == {c.uid: ""}

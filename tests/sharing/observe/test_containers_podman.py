"""Memory by container, with real containers: one claim serves two podman + runc containers (each
its own PID namespace and cgroup, as two containers of a pod); each holds a different amount
under the shim. `vgpu exporter` attributes each process to the claim and to its container by the
cgroup runc put it in, and serves one vgpu_container_memory_used_bytes series (and HAMi's
hami_vgpu_memory_used_bytes) per container, labelled with the container's ID as podman reports
it (--cidfile). Podman is no kubelet: the container names stay empty."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from sharing.observe.procinfo import SHORT_ID
from sharing.paths import sim_lib_dir
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer
from tests.support.observers import ExporterProcess, Sample, only, scrape
from tests.support.podman_containers import SIGNAL, Podman, missing_cuda, rootfs, wait_held, world

__all__ = ["rootfs", "world"]  # fixtures used by name
pytestmark = pytest.mark.slow
MiB = 1 << 20


def _start(podman: Podman, cdi_id: str, size: int, sub: str, cidfile: Path
           ) -> subprocess.Popen[str]:  # fmt: skip
    (podman.signal / sub).mkdir()
    cmd = podman.command(cdi_id, "hold", str(size), f"{SIGNAL}/{sub}")
    at = cmd.index("run") + 1
    cmd[at:at] = ["--cidfile", str(cidfile)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_containers_of_one_claim_get_their_own_memory(
    world: tuple[FakeApiServer, KubeletStandin, Path, Podman], tmp_path: Path
) -> None:
    if why := missing_cuda():
        pytest.skip(why)
    server, kubelet, root, podman = world
    c = claim_id(server.put(allocated_claim("shared", namespace="team-c",
                                            results=[result("gpu", "gpu-0", memory="2Gi")])))  # fmt: skip
    [cdi_id] = kubelet.prepare([c])[c.uid].devices[0].cdi_device_ids
    env = dict(os.environ, SIMGPU_STATE=str(podman.sim_state), LD_LIBRARY_PATH=str(sim_lib_dir()))
    env.pop("SIMGPU_CONFIG", None)
    sizes = {"a": 256 * MiB, "b": 768 * MiB}
    boxes = {k: _start(podman, cdi_id, n, k, tmp_path / f"{k}.cid") for k, n in sizes.items()}
    exp = None
    try:
        for k, box in boxes.items():
            wait_held(box, podman.signal / k)
        cids = {k: (tmp_path / f"{k}.cid").read_text().strip() for k in sizes}
        assert all(len(v) == 64 for v in cids.values()), cids
        exp = ExporterProcess(["--sim", "--data-dir", str(root / "data")], env)
        want = {cids[k][:SHORT_ID] for k in sizes}
        deadline = time.monotonic() + 30
        series: list[Sample] = []
        while time.monotonic() < deadline:
            series = only(scrape(exp.url), "vgpu_container_memory_used_bytes", claim_uid=c.uid)
            if {s.labels["container_id"] for s in series} == want:
                break
            time.sleep(0.3)
        by_container = {s.labels["container_id"]: s for s in series}
        assert {s.labels["container"] for s in series} == {""}
        assert set(by_container) == want, series
        for k, n in sizes.items():
            s = by_container[cids[k][:SHORT_ID]]
            # NVML's count: the allocation plus the process's context, never less
            assert s.value >= n, (k, s)
            assert s.labels["namespace"] == "team-c" and s.labels["dra_claim_name"] == "shared"
        a, b = (by_container[cids[k][:SHORT_ID]].value for k in ("a", "b"))
        assert b - a == sizes["b"] - sizes["a"]  # same context size each: the difference is exact
        hami = only(scrape(exp.url), "hami_vgpu_memory_used_bytes", claim_uid=c.uid)
        assert {h.labels["container_id"]: h.value for h in hami} == {
            k: s.value for k, s in by_container.items()
        }
        assert {h.labels["namespace"] for h in hami} == {"team-c"}
        for k in sizes:
            (podman.signal / k / "release").touch()
        for box in boxes.values():
            box.communicate(timeout=60)
            assert box.returncode == 0
    finally:
        for box in boxes.values():
            if box.poll() is None:
                box.kill()
                box.communicate(timeout=60)
        if exp is not None:
            exp.stop()
    assert kubelet.unprepare([c]) == {c.uid: ""}

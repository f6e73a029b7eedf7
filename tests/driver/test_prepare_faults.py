"""SIGKILL of the plugin process at each step of a prepare/unprepare, then restart: the claim is
either finished or rolled back, never half-done, and the retried call gives the same answer."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.driver.kubelet_standin import (
    DRIVER,
    KIND,
    ClaimId,
    KubeletStandin,
    allocated_claim,
    claim_id,
    result,
)
from tests.driver.plugin_process import PluginProcess, fake_gpus
from tests.fakes.apiserver import FakeApiServer

pytestmark = pytest.mark.slow


@pytest.fixture
def env() -> Iterator[tuple[Path, FakeApiServer]]:
    root = Path(tempfile.mkdtemp(prefix="vgf", dir="/tmp"))
    with FakeApiServer() as server:
        yield root, server
    shutil.rmtree(root, ignore_errors=True)


def artefacts(root: Path) -> tuple[list[str], list[str]]:
    """(CDI spec names, claim UIDs with files); a claim's files are all there or none is."""
    cdi = root / "cdi"
    claims = root / "data" / "claims"
    node_state = root / "data" / "node-state"
    dirs = sorted(p.name for p in claims.iterdir()) if claims.exists() else []
    demands = sorted(p.name[: -len(".demand")] for p in node_state.glob("*.demand"))
    assert demands == dirs, f"demand files {demands} != claim dirs {dirs}"
    for uid in dirs:
        assert sorted(p.name for p in (claims / uid).iterdir()) == [
            "limits",
            "metadata",
            "shared",
        ], uid
    return (sorted(p.name for p in cdi.iterdir()) if cdi.exists() else [], dirs)


def registered(root: Path) -> KubeletStandin:
    k = KubeletStandin(root / "registry" / f"{DRIVER}-reg.sock")
    k.register()
    return k


def spec_name(c: ClaimId) -> str:
    return f"k8s.{DRIVER}-claim_{c.uid}.json"


@pytest.mark.parametrize(
    "step", ["prepare-started", "prepare-dir", "prepare-cdi", "prepare-completed"]
)
def test_crash_during_prepare(env: tuple[Path, FakeApiServer], step: str) -> None:
    root, server = env
    c = claim_id(server.put(allocated_claim("c1", results=[result("gpu", "gpu-0", memory="2Gi")])))
    plugin = PluginProcess(root, server.url, fake_gpus())
    plugin.start(crash_at=step)
    kubelet = registered(root)
    with pytest.raises(grpc.RpcError) as e:
        kubelet.prepare([c])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # the process died mid-call
    kubelet.close()
    assert plugin.wait_exit() == -signal.SIGKILL

    plugin.start()
    try:
        if step == "prepare-completed":
            # Recorded as completed before the crash: finished, kept as is.
            assert artefacts(root) == ([spec_name(c)], [c.uid])
        else:
            # Interrupted: rolled back at startup, nothing left over.
            assert artefacts(root) == ([], [])
        kubelet = registered(root)
        # GETs of claims only: the claim status the plugin PATCHes after a prepare (from a
        # background thread) may land before or after the count.
        reads = server.count("GET", "resourceclaims")
        out = kubelet.prepare([c])
        assert out[c.uid].error == ""
        assert out[c.uid].devices[0].cdi_device_ids == [f"{KIND}={c.uid}"]
        reads_after = server.count("GET", "resourceclaims")
        # A finished prepare is answered from the checkpoint; a rolled-back one reads again.
        assert reads_after - reads == (0 if step == "prepare-completed" else 1)
        assert artefacts(root) == ([spec_name(c)], [c.uid])
        assert kubelet.prepare([c]) == out
        assert kubelet.unprepare([c]) == {c.uid: ""}
        assert artefacts(root) == ([], [])
        kubelet.close()
    finally:
        plugin.stop()


def crash_in_unprepare(root: Path, server: FakeApiServer, step: str, prepared: list[ClaimId],
                       unprepared: ClaimId) -> PluginProcess:  # fmt: skip
    """Prepare `prepared`, then unprepare `unprepared` in a plugin that SIGKILLs itself at
    `step`. Returns the (dead) plugin, to be started again."""
    plugin = PluginProcess(root, server.url, fake_gpus())
    plugin.start()
    kubelet = registered(root)
    assert all(r.error == "" for r in kubelet.prepare(prepared).values())
    kubelet.close()
    plugin.stop()
    plugin.start(crash_at=step)
    kubelet = registered(root)
    with pytest.raises(grpc.RpcError):
        kubelet.unprepare([unprepared])
    kubelet.close()
    assert plugin.wait_exit() == -signal.SIGKILL
    return plugin


@pytest.mark.parametrize("step", ["unprepare-started", "unprepare-cdi", "unprepare-dir"])
def test_crash_during_unprepare(env: tuple[Path, FakeApiServer], step: str) -> None:
    root, server = env
    c = claim_id(server.put(allocated_claim("c1", results=[result("gpu", "gpu-0", memory="2Gi")])))
    keep = claim_id(server.put(allocated_claim("c2", results=[result("gpu", "gpu-1")])))
    plugin = crash_in_unprepare(root, server, step, prepared=[c, keep], unprepared=c)
    plugin.start()
    try:
        kubelet = registered(root)
        assert kubelet.unprepare([c]) == {c.uid: ""}
        assert artefacts(root) == ([spec_name(keep)], [keep.uid])
        # The other claim survived the crash and restart intact.
        assert kubelet.prepare([keep])[keep.uid].devices[0].cdi_device_ids == [f"{KIND}={keep.uid}"]
        kubelet.close()
    finally:
        plugin.stop()


@pytest.mark.parametrize("step", ["unprepare-started", "unprepare-cdi", "unprepare-dir"])
def test_prepare_after_a_crashed_unprepare_answers_with_a_spec_that_exists(
    env: tuple[Path, FakeApiServer], step: str
) -> None:
    """A SIGKILL during unprepare once left the claim PrepareCompleted with its CDI spec gone;
    the next prepare answered success with a CDI id whose spec did not exist. The unprepare is
    now recorded (UnprepareStarted) and finished at the restart; the prepare starts afresh."""
    root, server = env
    c = claim_id(server.put(allocated_claim("c1", results=[result("gpu", "gpu-0", memory="2Gi")])))
    plugin = crash_in_unprepare(root, server, step, prepared=[c], unprepared=c)
    plugin.start()
    try:
        assert artefacts(root) == ([], [])  # the unprepare was finished at startup
        kubelet = registered(root)
        out = kubelet.prepare([c])
        assert out[c.uid].error == ""
        [cdi_id] = out[c.uid].devices[0].cdi_device_ids
        assert cdi_id == f"{KIND}={c.uid}"
        assert (root / "cdi" / spec_name(c)).is_file()  # the answer names a spec that exists
        assert artefacts(root) == ([spec_name(c)], [c.uid])
        kubelet.close()
    finally:
        plugin.stop()


def test_prepared_claims_survive_a_restart_without_the_api_server(
    env: tuple[Path, FakeApiServer],
) -> None:
    root, server = env
    c = claim_id(server.put(allocated_claim("c1", results=[result("gpu", "gpu-0", memory="3Gi")])))
    plugin = PluginProcess(root, server.url, fake_gpus())
    plugin.start()
    kubelet = registered(root)
    first = kubelet.prepare([c])
    kubelet.close()
    plugin.proc.kill()  # type: ignore[union-attr]
    plugin.wait_exit()
    server.down()
    plugin.start()
    try:
        kubelet = registered(root)
        assert kubelet.prepare([c]) == first
        assert kubelet.unprepare([c]) == {c.uid: ""}
        assert artefacts(root) == ([], [])
        kubelet.close()
    finally:
        plugin.stop()
        server.up()

"""Trees in a claim's directory, as a tenant of a claim prepared with a writable directory left
them (an older layout mounted `shared/` read-write; the layout now mounts the accounting file
alone, tests/driver/test_e2e_podman.py): a tree too deep for a recursive removal, a removal that
must not hold up other claims, and a recovery that meets any error on one claim."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from driver import hostfs
from driver.checkpoint import UNPREPARE_STARTED
from tests.driver.kubelet_standin import (
    DRIVER,
    KubeletStandin,
    allocated_claim,
    claim_id,
    result,
)
from tests.driver.plugin_process import PluginProcess, fake_gpus
from tests.fakes.apiserver import FakeApiServer
from tests.support.prepare_world import World, world

__all__ = ["world"]  # a fixture, used by name

DEPTH = 5000  # past Python's recursion limit (1000) and the default descriptor limit (1024)


def deep_tree(top: Path, depth: int) -> None:
    """`depth` nested directories under `top`, a file and a link to /etc/passwd every 100."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if i % 100 == 0:
                os.symlink("/etc/passwd", "link", dir_fd=fd)
                os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_deep_tree_in_the_claims_dir_unprepares(world: World) -> None:
    passwd = Path("/etc/passwd").read_bytes()
    c = world.claim("c", results=[result("gpu", "gpu-0", memory="1Gi")])
    assert world.kubelet.prepare([c])[c.uid].error == ""
    shared = world.root / "data" / "claims" / c.uid / "shared"
    deep_tree(shared, DEPTH)
    assert world.kubelet.unprepare([c]) == {c.uid: ""}
    assert not (world.root / "data" / "claims" / c.uid).exists()
    assert world.plugin.driver.state.trash_idle(300)  # removed in the background
    assert list((world.root / "data" / "trash").iterdir()) == []
    assert Path("/etc/passwd").read_bytes() == passwd  # links removed as links


def test_remove_tree_never_leaves_the_tree(tmp_path: Path) -> None:
    """Links to directories outside are removed as links; their targets stay."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "keep").write_text("keep\n")
    root = tmp_path / "root"
    (root / "t" / "a" / "b").mkdir(parents=True)
    (root / "t" / "a" / "b" / "up").symlink_to(outside)
    (root / "t" / "a" / "sub").symlink_to(outside / "sub")
    assert hostfs.remove(root / "t", root)
    assert list(root.iterdir()) == []
    assert (outside / "sub" / "keep").read_text() == "keep\n"


@pytest.fixture
def env() -> Iterator[tuple[Path, FakeApiServer]]:
    root = Path(tempfile.mkdtemp(prefix="vgt", dir="/tmp"))
    with FakeApiServer() as server:
        yield root, server
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_a_deep_tree_left_by_a_crash_does_not_stop_the_next_start(
    env: tuple[Path, FakeApiServer],
) -> None:
    """The plugin dies in the unprepare of a claim whose directory holds a deep tree; every
    later start must come up (and finish the unprepare), not exit 1."""
    root, server = env
    claims = [
        claim_id(server.put(allocated_claim(n, results=[result("gpu", "gpu-0", memory="1Gi")])))
        for n in ("deep", "other")
    ]
    deep, other = claims
    plugin = PluginProcess(root, server.url, fake_gpus())
    plugin.start()
    kubelet = KubeletStandin(root / "registry" / f"{DRIVER}-reg.sock")
    kubelet.register()
    assert all(r.error == "" for r in kubelet.prepare(claims).values())
    kubelet.close()
    plugin.stop()
    deep_tree(root / "data" / "claims" / deep.uid / "shared", DEPTH)
    plugin.start(crash_at="unprepare-started")
    kubelet = KubeletStandin(root / "registry" / f"{DRIVER}-reg.sock")
    kubelet.register()
    with pytest.raises(grpc.RpcError):
        kubelet.unprepare([deep])
    kubelet.close()
    assert plugin.wait_exit() == -signal.SIGKILL

    for _ in range(2):  # the start after the crash, and one more
        plugin.start()  # READY, or the test fails with the plugin's log
        kubelet = KubeletStandin(root / "registry" / f"{DRIVER}-reg.sock")
        kubelet.register()
        assert kubelet.unprepare([deep]) == {deep.uid: ""}
        assert kubelet.prepare([other])[other.uid].error == ""  # still prepared, answered
        kubelet.close()
        plugin.stop()
    assert not (root / "data" / "claims" / deep.uid).exists()
    # the moved tree is removed in the background after a start (a start removes what an
    # earlier one left in the trash)
    plugin.start()
    try:
        deadline = time.monotonic() + 120
        while list((root / "data" / "trash").iterdir()):
            assert time.monotonic() < deadline, "the trash was never emptied"
            time.sleep(0.2)
    finally:
        plugin.stop()
    log = (root / "plugin.log").read_text()
    assert "recursion" not in log, log[-3000:]


def test_removing_a_big_tree_does_not_hold_another_claims_prepare(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While claim a's directory is being removed (held at its removal by this test), claim b
    is prepared: the removal runs outside the plugin's lock (and after a's unprepare answered).
    Ordering, not time: b's prepare completes while a's removal has not."""
    a = world.claim("a", results=[result("gpu", "gpu-0", memory="1Gi")])
    b = world.claim("b", results=[result("gpu", "gpu-0", memory="1Gi")])
    assert world.kubelet.prepare([a])[a.uid].error == ""
    removing, release = threading.Event(), threading.Event()
    real_remove = hostfs.remove

    def held_remove(path: Path, root: Path) -> bool:
        if path.name.startswith(a.uid) and path.is_dir() and not path.is_symlink():
            removing.set()
            release.wait(60)
        return real_remove(path, root)

    monkeypatch.setattr(hostfs, "remove", held_remove)
    unprepared: dict[str, str] = {}
    t = threading.Thread(target=lambda: unprepared.update(world.kubelet.unprepare([a])))
    t.start()
    try:
        assert removing.wait(30), "a's directory was never removed"
        prepared: dict[str, str] = {}
        p = threading.Thread(
            target=lambda: prepared.update({b.uid: world.kubelet.prepare([b])[b.uid].error})
        )
        p.start()
        p.join(30)  # on a plugin that removes under its lock, this waits for `release`
        finished_first = not p.is_alive() and not release.is_set()
    finally:
        release.set()
        t.join(60)
        p.join(60)
    assert finished_first, "b's prepare waited for a's removal"
    assert prepared == {b.uid: ""} and unprepared == {a.uid: ""}
    assert not (world.root / "data" / "claims" / a.uid).exists()
    assert world.plugin.driver.state.trash_idle(60)
    assert list((world.root / "data" / "trash").iterdir()) == []


@pytest.mark.slow
def test_recovery_survives_any_error_on_one_claim(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two unprepares interrupted by a restart; finishing one raises something that is not an
    OSError. The other is finished, the plugin's recovery returns, one line names the claim."""
    a = world.claim("a", results=[result("gpu", "gpu-0", memory="1Gi")])
    b = world.claim("b", results=[result("gpu", "gpu-0", memory="1Gi")])
    assert all(r.error == "" for r in world.kubelet.prepare([a, b]).values())
    state = world.plugin.driver.state
    for e in state.checkpoint.entries():
        state.checkpoint.put(replace(e, state=UNPREPARE_STARTED))
    real = hostfs.move_aside

    def failing(path: Path, root: Path, trash: Path) -> str | None:
        if path.name == a.uid:
            raise RecursionError("maximum recursion depth exceeded")
        return real(path, root, trash)

    monkeypatch.setattr(hostfs, "move_aside", failing)
    with caplog.at_level(logging.ERROR, logger="driver.state"):
        state.recover()
    assert [e.uid for e in state.checkpoint.entries()] == [a.uid]  # b finished, a kept
    assert not (world.root / "data" / "claims" / b.uid).exists()
    lines = [r.getMessage() for r in caplog.records if a.uid in r.getMessage()]
    assert len(lines) == 1 and "recovery failed" in lines[0], lines

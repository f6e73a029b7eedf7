"""The plugin against hostile input and planted links, through the real gRPC sockets.

Each test performs one attack found in the review and checks that it now fails safely:
claim UIDs that are not UIDs, checkpoints that name paths outside the plugin's directories, a
recovery that meets a failing entry, files of a prepared claim that vanished, links planted
where the plugin creates, rewrites or deletes files, and a claim's own config switching its
compute cap off. A planted link's target must be
byte-for-byte (and mode-for-mode) unchanged after prepare, unprepare and recovery.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from driver import hostfs
from driver.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    UNPREPARE_STARTED,
    CheckpointError,
    ClaimEntry,
    _checksum,
)
from sharing.limitsfile import parse_limits_file
from sharing.policy import BUILTIN
from tests.driver.kubelet_standin import DRIVER, ClaimId, KubeletStandin, result, vgpu_config
from tests.driver.plugin_process import InProcessPlugin
from tests.support.prepare_world import World, close_world, make_world, world

__all__ = ["world"]  # a fixture, used by name

GiB = 1024**3


def restart(w: World) -> None:
    """Stop the plugin and start a new one on the same directories (a restart: recover())."""
    w.kubelet.close()
    w.plugin.driver.stop()
    w.plugin = InProcessPlugin(w.root, w.server.api_client())
    w.plugin.driver.start()
    w.kubelet = KubeletStandin(w.plugin.registration_socket)
    w.kubelet.register()


def paths(w: World, uid: str) -> dict[str, Path]:
    data = w.root / "data"
    return {
        "spec": w.root / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json",
        "dir": data / "claims" / uid,
        "limits": data / "claims" / uid / "limits",
        "shared": data / "claims" / uid / "shared",
        "demand": data / "node-state" / f"{uid}.demand",
        "metadata": data / "claims" / uid / "metadata" / "gpu.json",  # request "gpu" (KEP-5304)
    }


def victims(root: Path) -> Path:
    """Files and a directory outside the plugin's directories, each with its own mode."""
    v = root / "victim"
    v.mkdir(mode=0o700)
    (v / "passwd").write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    os.chmod(v / "passwd", 0o600)
    (v / "dir").mkdir(mode=0o750)
    (v / "dir" / "keep").write_bytes(b"keep me\n")
    os.chmod(v / "dir" / "keep", 0o640)
    return v


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry below root: (mode, content for files)."""
    out: dict[str, tuple[int, bytes | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(root))] = (
                st.st_mode,
                p.read_bytes() if stat.S_ISREG(st.st_mode) else None,
            )
    out["."] = (root.lstat().st_mode, None)
    return out


def forge_checkpoint(w: World, entries: list[ClaimEntry]) -> None:
    """A checkpoint with a valid checksum (as an older plugin, or an attacker, left it)."""
    cp = w.root / "data" / "checkpoint.json"
    doc: dict[str, Any] = (
        json.loads(cp.read_text()) if cp.exists() else {"version": 1, "claims": {}}
    )
    for e in entries:
        doc["claims"][e.uid] = e.to_dict()
    doc["checksum"] = _checksum(doc["claims"])
    cp.write_text(json.dumps(doc))


def entry(uid: str, state: str, spec: Path | str, claim_dir: Path | str) -> ClaimEntry:
    return ClaimEntry(uid=uid, namespace="default", name="x", state=state, cdi_spec=str(spec),
                      claim_dir=str(claim_dir))  # fmt: skip


# --- claim UIDs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uid", "message"),
    [
        ("8b0c1a4e-0000-4000-8000-000000000000\n", r"invalid; allowed: letters, digits and '-'"),
        ("a" * 300, r"claim UID of 300 characters invalid; allowed: at most 128"),
        ("../../etc", r"invalid"),
        ("-rf", r"invalid"),
        ("", r"invalid"),
    ],
)
def test_bad_claim_uids_are_refused_before_anything_happens(
    world: World, uid: str, message: str
) -> None:
    """A trailing newline passed the old `^...$` regex; a 300-character UID passed too and left
    a PrepareStarted entry whose paths were too long to remove (recover() then crashed)."""
    bad = ClaimId("default", "c1", uid)
    reads = world.server.count("GET", "resourceclaims")
    out = world.kubelet.prepare([bad])
    assert out[uid].devices == []
    assert out[uid].error.startswith("claim UID") and "\n" not in out[uid].error
    assert world.server.count("GET", "resourceclaims") == reads  # refused before the API read
    assert re.search(message, out[uid].error), out[uid].error
    assert re.search(message, world.kubelet.unprepare([bad])[uid])
    assert world.plugin.driver.state.prepared() == []
    assert world.plugin.cdi_specs() == [] and world.plugin.claim_dirs() == []


@pytest.mark.slow
def test_recovery_drops_an_entry_whose_uid_is_not_a_uid(world: World) -> None:
    """An older plugin left a PrepareStarted entry with a 300-character UID; the next start
    crashed in recover() with ENAMETOOLONG. Now the entry is dropped (logged), the rest kept."""
    good = world.claim("good", results=[result("gpu", "gpu-0", memory="1Gi")])
    first = world.kubelet.prepare([good])
    long_uid = "a" * 300
    data = world.root / "data"
    forge_checkpoint(world, [
        entry(long_uid, PREPARE_STARTED, world.root / "cdi" / f"k8s.{DRIVER}-claim_{long_uid}.json",
              data / "claims" / long_uid),
        entry("x\n", PREPARE_COMPLETED, world.root / "cdi" / "y.json", data / "claims" / "x\n"),
    ])  # fmt: skip
    restart(world)
    assert [e.uid for e in world.plugin.driver.state.prepared()] == [good.uid]
    assert world.kubelet.prepare([good]) == first
    assert sorted(p.name for p in world.plugin.claim_dirs()) == [good.uid]


@pytest.mark.slow
def test_recovery_goes_on_when_one_entry_fails(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Any OSError on one entry is logged; the other entries are recovered and the plugin
    starts."""
    a = world.claim("a", results=[result("gpu", "gpu-0", memory="1Gi")])
    b = world.claim("b", results=[result("gpu", "gpu-0", memory="1Gi")])
    world.kubelet.prepare([a, b])
    pa, pb = paths(world, a.uid), paths(world, b.uid)
    forge_checkpoint(world, [
        entry(a.uid, PREPARE_STARTED, pa["spec"], pa["dir"]),
        entry(b.uid, PREPARE_STARTED, pb["spec"], pb["dir"]),
    ])  # fmt: skip
    real_remove = hostfs.remove

    def failing(path: Path, root: Path) -> bool:
        if a.uid in path.name:
            raise PermissionError(13, "Permission denied", str(path))
        return real_remove(path, root)

    monkeypatch.setattr(hostfs, "remove", failing)
    restart(world)
    assert any("recovery failed: [Errno 13] Permission denied" in m for m in caplog.messages)
    # b was rolled back; a keeps its entry (retried at the next prepare or start).
    assert [(e.uid, e.state) for e in world.plugin.driver.state.prepared()] == [
        (a.uid, PREPARE_STARTED)
    ]
    assert not pb["dir"].exists() and not pb["spec"].exists()
    monkeypatch.undo()
    assert world.kubelet.prepare([a])[a.uid].error == ""
    assert world.kubelet.unprepare([a, b]) == {a.uid: "", b.uid: ""}
    assert world.plugin.claim_dirs() == []


@pytest.mark.parametrize("state", [PREPARE_STARTED, UNPREPARE_STARTED, PREPARE_COMPLETED])
def test_a_checkpoint_cannot_make_the_plugin_delete_outside_its_directories(
    world: World, state: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A checksum-valid entry naming /etc-like paths made recovery delete them. Paths are now
    derived from the UID inside the plugin's directories; a different recorded path is logged
    and left alone, at recovery and at unprepare."""
    v = victims(world.root)
    before = snapshot(v)
    uid = "8b0c1a4e-0000-4000-8000-00000000beef"
    forge_checkpoint(world, [entry(uid, state, v / "passwd", v / "dir")])
    restart(world)
    world.kubelet.unprepare([ClaimId("default", "x", uid)])
    assert snapshot(v) == before
    assert any("not deleting it" in m for m in caplog.messages)


# --- files of a prepared claim that vanished ----------------------------------------------------


@pytest.mark.slow
def test_missing_spec_is_recreated_keeping_the_slices_usage(world: World) -> None:
    """/var/run/cdi is a tmpfs: after a node reboot the specs are gone while the checkpoint says
    prepared. The old plugin answered with a CDI id whose spec did not exist."""
    c = world.claim("c1", results=[result("gpu", "gpu-0", memory="2Gi", cores="30")])
    first = world.kubelet.prepare([c])
    p = paths(world, c.uid)
    (p["shared"] / "usage-marker").write_text("in use\n")
    accounting = (p["shared"] / "accounting").read_bytes()
    for gone in ("spec", "limits", "demand", "metadata"):
        p[gone].unlink()
        reads = world.server.count("GET", "resourceclaims")
        assert world.kubelet.prepare([c]) == first
        assert world.server.count("GET", "resourceclaims") == reads + 1  # re-read to recreate
        assert all(p[f].is_file() for f in ("spec", "limits", "demand", "metadata"))
        assert (p["shared"] / "usage-marker").read_text() == "in use\n"  # usage kept
        assert (p["shared"] / "accounting").read_bytes() == accounting
        assert parse_limits_file(p["limits"].read_text())["CUDA_DEVICE_SM_LIMIT_0"] == "30"
    reads = world.server.count("GET", "resourceclaims")
    assert world.kubelet.prepare([c]) == first
    assert (
        world.server.count("GET", "resourceclaims") == reads
    )  # all in place: answered from the checkpoint


@pytest.mark.slow
def test_missing_spec_with_the_api_down_fails_the_claim_clearly(world: World) -> None:
    c = world.claim("c1", results=[result("gpu", "gpu-0", memory="2Gi")])
    world.kubelet.prepare([c])
    p = paths(world, c.uid)
    p["spec"].unlink()
    world.server.down()
    try:
        out = world.kubelet.prepare([c])
    finally:
        world.server.up()
    err = out[c.uid].error
    assert out[c.uid].devices == []
    assert err.startswith(f"prepared earlier, but {p['spec']} is gone and reading the claim to "
                          "recreate it failed: ") and "\n" not in err  # fmt: skip
    assert world.kubelet.prepare([c])[c.uid].error == ""  # the API is back: recreated
    assert p["spec"].is_file()


# --- planted links ------------------------------------------------------------------------------


@pytest.mark.slow
def test_link_planted_at_the_demand_file_is_replaced_not_followed(world: World) -> None:
    c = world.claim("c1", results=[result("gpu", "gpu-0", memory="1Gi")])
    v = victims(world.root)
    before = snapshot(v)
    p = paths(world, c.uid)
    p["demand"].symlink_to(v / "passwd")  # before the claim is prepared
    assert world.kubelet.prepare([c])[c.uid].error == ""
    assert snapshot(v) == before  # not chmod'ed 0666, not truncated
    st = p["demand"].lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_size == 0 and stat.S_IMODE(st.st_mode) == 0o666
    # Planted again under a prepared claim: the check before "already prepared" sees it.
    p["demand"].unlink()
    p["demand"].symlink_to(v / "passwd")
    assert world.kubelet.prepare([c])[c.uid].error == ""
    assert stat.S_ISREG(p["demand"].lstat().st_mode)
    p["demand"].unlink()
    p["demand"].symlink_to(v / "passwd")
    assert world.kubelet.unprepare([c]) == {c.uid: ""}
    assert not p["demand"].is_symlink()
    assert snapshot(v) == before


@pytest.mark.slow
def test_link_planted_at_the_limits_file_is_replaced_not_followed(world: World) -> None:
    c = world.claim("c1", results=[result("gpu", "gpu-0", memory="1Gi")])
    world.kubelet.prepare([c])
    v = victims(world.root)
    before = snapshot(v)
    p = paths(world, c.uid)
    p["limits"].unlink()
    p["limits"].symlink_to(v / "passwd")
    assert world.kubelet.prepare([c])[c.uid].error == ""  # not a regular file: rewritten
    assert snapshot(v) == before
    st = p["limits"].lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o444
    assert parse_limits_file(p["limits"].read_text())["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(GiB)
    p["limits"].unlink()
    p["limits"].symlink_to(v / "passwd")
    restart(world)  # recovery with the link in place
    assert world.kubelet.unprepare([c]) == {c.uid: ""}
    assert snapshot(v) == before


def plant_in_shared(shared: Path, v: Path) -> None:
    """What a container's root can do in /run/vgpu-sharing."""
    (shared / "accounting").unlink()
    (shared / "accounting").symlink_to(v / "passwd")
    (shared / "dirlink").symlink_to(v / "dir")
    (shared / "limits").symlink_to(v / "passwd")
    (shared / "sub").mkdir()
    (shared / "sub" / "deep").symlink_to(v / "dir" / "keep")
    os.link(v / "passwd", shared / "hardlink")  # same file system here


@pytest.mark.slow
def test_links_planted_in_the_shared_dir_are_never_followed(world: World) -> None:
    """The tenant-writable shared/ dir, full of links, through a repair-prepare, a restart
    (recovery and orphan sweep) and unprepare."""
    c = world.claim("c1", results=[result("gpu", "gpu-0", memory="1Gi")])
    first = world.kubelet.prepare([c])
    v = victims(world.root)
    p = paths(world, c.uid)
    plant_in_shared(p["shared"], v)
    before = snapshot(v)
    p["spec"].unlink()  # forces the repair path, which works beside the shared dir
    assert world.kubelet.prepare([c]) == first
    restart(world)
    assert world.kubelet.prepare([c]) == first
    assert snapshot(v) == before
    assert world.kubelet.unprepare([c]) == {c.uid: ""}
    assert not p["dir"].exists()
    assert snapshot(v) == before


@pytest.mark.slow
def test_links_in_place_of_claim_files_are_removed_as_links(world: World) -> None:
    """A claim directory, spec or demand file that is a link (to a victim) at unprepare, and
    links in the plugin's directories that look like orphans at a restart: removed, targets
    untouched. (The old rmtree refused a linked claim directory and failed the unprepare.)"""
    c = world.claim("c1", results=[result("gpu", "gpu-0", memory="1Gi")])
    world.kubelet.prepare([c])
    v = victims(world.root)
    before = snapshot(v)
    p = paths(world, c.uid)
    hostfs.remove(p["dir"], p["dir"].parent)
    p["dir"].symlink_to(v / "dir")
    p["spec"].unlink()
    p["spec"].symlink_to(v / "passwd")
    assert world.kubelet.unprepare([c]) == {c.uid: ""}
    assert not p["dir"].is_symlink() and not p["spec"].is_symlink()
    assert snapshot(v) == before
    data = world.root / "data"
    (data / "claims" / "orphan").symlink_to(v / "dir")
    (data / "node-state" / "orphan.demand").symlink_to(v / "passwd")
    (world.root / "cdi" / f"k8s.{DRIVER}-claim_orphan.json").symlink_to(v / "passwd")
    restart(world)
    assert world.plugin.claim_dirs() == [] and world.plugin.cdi_specs() == []
    assert list((data / "node-state").iterdir()) == []
    assert snapshot(v) == before


def test_hostfs_refuses_paths_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (tmp_path / "outside").write_text("x")
    (root / "up").symlink_to(tmp_path)
    for bad in (tmp_path / "outside", root / ".." / "outside", root / "up" / "outside", root):
        with pytest.raises(hostfs.OutsideError, match="outside"):
            hostfs.remove(bad, root)
    assert (tmp_path / "outside").read_text() == "x"
    assert hostfs.remove(root / "a", root) and not (root / "a").exists()
    assert hostfs.remove(root / "up", root) and (tmp_path / "outside").exists()


def test_links_in_place_of_the_plugins_own_files_are_not_followed(world: World) -> None:
    """The shim copy and the preload file are rewritten over a link; a checkpoint that is a link
    stops the start (one line) instead of being read through it or replaced."""
    v = victims(world.root)
    before = snapshot(v)
    lib = world.root / "data" / "lib"
    for name in ("libvgpu.so", "ld.so.preload"):
        (lib / name).unlink()
        (lib / name).symlink_to(v / "passwd")
    restart(world)
    assert snapshot(v) == before
    assert stat.S_ISREG((lib / "ld.so.preload").lstat().st_mode)
    assert (lib / "ld.so.preload").read_text() == "/usr/local/lib/vgpu-sharing/libvgpu.so\n"
    assert stat.S_ISREG((lib / "libvgpu.so").lstat().st_mode)
    world.kubelet.close()
    world.plugin.driver.stop()
    cp = world.root / "data" / "checkpoint.json"
    cp.unlink(missing_ok=True)
    cp.symlink_to(v / "passwd")
    again = InProcessPlugin(world.root, world.server.api_client())
    with pytest.raises(CheckpointError, match=r"checkpoint .* cannot be read: .*symbolic link"):
        again.driver.start()
    again.driver.stop()
    assert snapshot(v) == before
    cp.unlink()
    world.plugin = InProcessPlugin(world.root, world.server.api_client())
    world.plugin.driver.start()
    world.kubelet = KubeletStandin(world.plugin.registration_socket)
    world.kubelet.register()


UNCAPPED = {"computePolicy": "off", "priority": -100}


def test_a_claims_own_config_cannot_switch_its_cap_off(world: World) -> None:
    """Issue 33 part 4: allocated `cores: 10`, a claim's own VgpuConfig asked for
    `computePolicy: off, priority: -100` and the plugin (built-in policy, as deploy/base's)
    prepared it uncapped and served first. Now prepare fails with one line naming what is
    allowed (the kubelet posts it on the pod), and nothing of the claim is left behind."""
    share = result("gpu", "gpu-0", memory="4Gi", cores="10")
    c = world.claim("uncapped", results=[share], configs=[vgpu_config("FromClaim", UNCAPPED)])
    high = world.claim(
        "served-first", results=[share], configs=[vgpu_config("FromClaim", {"priority": -100})]
    )
    out = world.kubelet.prepare([c, high])
    assert out[c.uid].error == (
        "device gpu-0: config[0] (FromClaim): VgpuConfig computePolicy 'off' is not allowed by "
        "the node's sharing policy (allowedComputePolicies: [hard, elastic]); allowed: hard, "
        "elastic or leave computePolicy out"
    )
    assert "VgpuConfig priority -100 is higher than the node's sharing policy allows" in (
        out[high.uid].error
    )
    assert out[c.uid].devices == [] and out[high.uid].devices == []
    assert world.plugin.cdi_specs() == [] and world.plugin.claim_dirs() == []


def test_an_admin_listing_off_lets_the_claim_run_uncapped() -> None:
    rules = replace(BUILTIN, allowed_compute_policies=("hard", "off"), highest_priority=-100)
    w = make_world(rules_for=lambda _gpu: rules)
    try:
        share = result("gpu", "gpu-0", memory="4Gi", cores="10")
        c = w.claim("uncapped", results=[share], configs=[vgpu_config("FromClaim", UNCAPPED)])
        assert w.kubelet.prepare([c])[c.uid].error == ""
        limits = parse_limits_file((w.root / "data" / "claims" / c.uid / "limits").read_text())
        assert (limits["VGPU_COMPUTE_POLICY"], limits["VGPU_PRIORITY"]) == ("off", "-100")
        assert limits["CUDA_DEVICE_SM_LIMIT_0"] == "10"
    finally:
        close_world(w)

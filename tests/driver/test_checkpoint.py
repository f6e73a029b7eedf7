"""The checkpoint: atomic, checksummed, and loud when it cannot be trusted."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from driver.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    CheckpointError,
    ClaimEntry,
    PreparedDevice,
    _checksum,
)
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.driver.plugin_process import InProcessPlugin
from tests.fakes.apiserver import FakeApiServer


def entry(uid: str, state: str = PREPARE_COMPLETED) -> ClaimEntry:
    return ClaimEntry(
        uid=uid,
        namespace="default",
        name=f"claim-{uid[:4]}",
        state=state,
        cdi_spec=f"/var/run/cdi/x_{uid}.json",
        claim_dir=f"/var/lib/vgpu-sharing/claims/{uid}",
        devices=(
            PreparedDevice(
                ("gpu",), "node-a", "gpu-0", (f"k8s.vgpu.sharing.dev/claim={uid}",), "s1"
            ),
        ),
    )


def test_roundtrip_and_delete(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    cp = Checkpoint(path)
    cp.load()  # absent file: no claims
    assert cp.entries() == []
    cp.put(entry("aaaa-1"))
    cp.put(entry("bbbb-2", PREPARE_STARTED))
    again = Checkpoint(path)
    again.load()
    assert again.get("aaaa-1") == entry("aaaa-1")
    assert again.get("bbbb-2") == entry("bbbb-2", PREPARE_STARTED)
    again.delete("aaaa-1")
    again.delete("never-there")
    third = Checkpoint(path)
    third.load()
    assert [e.uid for e in third.entries()] == ["bbbb-2"]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]  # no temp files left


def test_bad_checksum_is_an_error_not_silent_loss(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    cp = Checkpoint(path)
    cp.put(entry("aaaa-1"))
    doc = json.loads(path.read_text())
    doc["claims"]["aaaa-1"]["name"] = "tampered"
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"is corrupt: checksum sha256:\w+ does not match"):
        Checkpoint(path).load()
    assert json.loads(path.read_text()) == doc  # left for inspection, not overwritten


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is corrupt: not JSON"),
        ('{"version": 99, "claims": {}}', "version 99 unsupported; allowed: 1"),
        ('{"version": 1, "claims": []}', "'claims' is not an object"),
        (
            '{"version": 1, "checksum": "sha256:0", "claims": {}}',
            "checksum sha256:0 does not match",
        ),
    ],
)
def test_unreadable_checkpoints(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_text(content)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(path).load()
    assert message in str(e.value)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_bad_state_in_entry(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    cp = Checkpoint(path)
    cp.put(entry("aaaa-1"))
    doc = json.loads(path.read_text())
    doc["claims"]["aaaa-1"]["state"] = "Halfway"
    from driver.checkpoint import _checksum

    doc["checksum"] = _checksum(doc["claims"])
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="state 'Halfway' unknown"):
        Checkpoint(path).load()


def test_driver_refuses_to_start_on_corrupt_checkpoint() -> None:
    root = Path(tempfile.mkdtemp(prefix="vgc", dir="/tmp"))
    try:
        with FakeApiServer() as server:
            plugin = InProcessPlugin(root, server.api_client())
            plugin.driver.start()
            kubelet = KubeletStandin(plugin.registration_socket)
            kubelet.register()
            c = claim_id(server.put(allocated_claim("c1", results=[result("gpu", "gpu-0")])))
            assert kubelet.prepare([c])[c.uid].error == ""
            kubelet.close()
            plugin.driver.stop()

            cp = root / "data" / "checkpoint.json"
            cp.write_text(cp.read_text().replace('"c1"', '"c2"'))
            again = InProcessPlugin(root, server.api_client())
            with pytest.raises(CheckpointError, match="checksum"):
                again.driver.start()
            # Nothing was cleaned up on the strength of a checkpoint we cannot read.
            assert len(again.cdi_specs()) == 1 and len(again.claim_dirs()) == 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_failed_write_keeps_memory_equal_to_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    cp = Checkpoint(path)
    cp.put(entry("aaaa-1"))

    def boom(*_: object, **__: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError, match="disk full"):
        cp.put(entry("bbbb-2"))
    with pytest.raises(OSError, match="disk full"):
        cp.delete("aaaa-1")
    assert [e.uid for e in cp.entries()] == ["aaaa-1"]
    monkeypatch.undo()
    fresh = Checkpoint(path)
    fresh.load()
    assert [e.uid for e in fresh.entries()] == ["aaaa-1"]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]


def test_a_reclaim_record_names_each_borrowers_policy_and_reads_an_older_plugins(
    tmp_path: Path,
) -> None:
    """A reclaim's record holds [uid, gpu, policy, deadline] per borrower (GPUs of one claim
    may have different policies); a record an older plugin wrote ([uid, gpu], one policy and
    deadline for all) is read into that form, and one that is neither is refused."""
    path = tmp_path / "checkpoint.json"
    now = [["u-a", 0, "evict", 5], ["u-b", 1, "wait", 9]]
    older = [["u-a", 0], ["u-b", 1]]
    for borrowers, want in ((now, now), (older, [["u-a", 0, "evict", 9], ["u-b", 1, "evict", 9]])):
        cp = Checkpoint(path)
        cp.put(entry("aaaa-1", PREPARE_STARTED))
        doc = json.loads(path.read_text())
        doc["claims"]["aaaa-1"]["reclaim"] = {
            "policy": "evict", "deadline_unix_ns": 9, "borrowers": borrowers,
        }  # fmt: skip
        doc["checksum"] = _checksum(doc["claims"])
        path.write_text(json.dumps(doc))
        again = Checkpoint(path)
        again.load()
        got = again.get("aaaa-1")
        assert got is not None and got.reclaim is not None
        assert got.reclaim["borrowers"] == want
    doc["claims"]["aaaa-1"]["reclaim"]["borrowers"] = [["u-a", 0, "drop", 5]]
    doc["checksum"] = _checksum(doc["claims"])
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="reclaim record"):
        Checkpoint(path).load()

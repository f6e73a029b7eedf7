"""The claim's device status (driver/claimstatus.py): what the plugin writes after prepare, through
the real kubernetes client to the fake API server (which validates every write against the
official schemas of 1.34-1.37 and refuses entries for devices not allocated), and what it does
where the server is older than 1.36 or refuses."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from sharing.kubequantity import to_kubernetes
from tests.driver.kubelet_standin import (
    DRIVER,
    NODE,
    allocated_claim,
    claim_id,
    result,
)
from tests.driver.plugin_process import fake_gpus
from tests.driver.plugin_world import PluginWorld
from tests.fakes.apiserver import FakeApiServer

GiB = 1024**3
ALL_VERSIONS = ("1.34", "1.35", "1.36", "1.37")


class World(PluginWorld):
    def __init__(self, **server: Any) -> None:
        super().__init__(FakeApiServer(validate_versions=ALL_VERSIONS, **server))

    def status_patches(self) -> list[Any]:
        return [r for r in self.server.requests if r.method == "PATCH"]


@pytest.fixture
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    w = World(**getattr(request, "param", {}))
    yield w
    w.close()


@pytest.mark.slow
def test_prepare_writes_each_device_status_beside_other_drivers(world: World) -> None:
    other = {"request": "nic", "driver": "nic.example.com", "pool": NODE, "device": "eth1"}
    claim = allocated_claim(
        "c1",
        results=[
            result("gpu", "gpu-0", memory="4Gi", cores="30"),
            result("gpu2", "gpu-1", memory="2Gi", cores="50"),
            other,
        ],
    )
    theirs = {**{k: other[k] for k in ("driver", "pool", "device")},
              "data": {"interface": "eth1"}}  # fmt: skip
    claim["status"]["devices"] = [theirs]
    c = claim_id(world.server.put(claim))
    stored = world.server.get("ResourceClaim", "default", "c1")
    assert stored is not None
    shares = {
        r["device"]: r.get("shareID") for r in stored["status"]["allocation"]["devices"]["results"]
    }

    assert world.kubelet.prepare([c])[c.uid].error == ""
    world.plugin.driver.claim_status.idle()

    [patch] = world.status_patches()
    assert patch.path == "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c1/status"
    assert patch.content_type == "application/apply-patch+yaml"
    assert patch.query["fieldManager"] == [DRIVER] and patch.query["force"] == ["true"]
    got = world.server.get("ResourceClaim", "default", "c1")
    assert got is not None
    devices = got["status"]["devices"]
    assert theirs in devices  # another driver's entry is untouched
    ours = {d["device"]: d for d in devices if d["driver"] == DRIVER}
    gpus = fake_gpus()
    for name, gpu, memory, sm in (("gpu-0", gpus[0], 4 * GiB, 30), ("gpu-1", gpus[1], 2 * GiB, 50)):
        d = ours.pop(name)
        assert (d["pool"], d["shareID"]) == (NODE, shares[name])
        [cond] = d["conditions"]
        assert (cond["type"], cond["status"], cond["reason"]) == ("Ready", "True", "Prepared")
        assert d["data"] == {
            "memoryLimitBytes": memory,
            "memoryLimit": to_kubernetes(memory),
            "smLimitPercent": sm,
            "computePolicy": "hard",
            "priority": 1,
            "gpuUUID": gpu.uuid,
            "gpuIndex": gpu.index,
        }
    assert ours == {}
    assert world.plugin.driver.claim_status.written == 1


def test_a_prepared_claim_answered_from_the_checkpoint_writes_nothing_again(world: World) -> None:
    c = claim_id(world.server.put(allocated_claim("c1")))
    assert world.kubelet.prepare([c])[c.uid].error == ""
    assert world.kubelet.prepare([c])[c.uid].error == ""
    world.plugin.driver.claim_status.idle()
    assert len(world.status_patches()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("world", [{"server_version": "1.35"}], indirect=True)
def test_older_servers_get_no_status_write(world: World, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="driver.claimstatus")
    for name in ("c1", "c2"):
        c = claim_id(world.server.put(allocated_claim(name)))
        assert world.kubelet.prepare([c])[c.uid].error == ""
    world.plugin.driver.claim_status.idle()
    assert world.status_patches() == []
    assert [r.path for r in world.server.requests if r.path.startswith("/version")] == ["/version/"]
    lines = [r.getMessage() for r in caplog.records if r.name == "driver.claimstatus"]
    assert len(lines) == 1 and "API server is 1.35" in lines[0], lines
    got = world.server.get("ResourceClaim", "default", "c1")
    assert got is not None and "devices" not in got["status"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "code"),
    [({"claim_status": "forbid"}, 403), ({"claim_status": "absent"}, 404)],
    indirect=["world"],
)
def test_a_refusing_server_gets_one_attempt_and_one_line(
    world: World, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="driver.claimstatus")
    for name in ("c1", "c2", "c3"):
        c = claim_id(world.server.put(allocated_claim(name)))
        assert world.kubelet.prepare([c])[c.uid].error == ""  # prepare is unaffected
        world.plugin.driver.claim_status.idle()
    assert len(world.status_patches()) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "driver.claimstatus"]
    assert len(lines) == 1 and f"HTTP {code}" in lines[0], lines


def test_unprepare_removes_our_entries_and_only_ours(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    other = {"request": "nic", "driver": "nic.example.com", "pool": NODE, "device": "eth1"}
    claim = allocated_claim("c1", results=[result("gpu", "gpu-0", memory="4Gi"), other])
    theirs = {**{k: other[k] for k in ("driver", "pool", "device")}, "data": {"if": "eth1"}}
    claim["status"]["devices"] = [theirs]
    c = claim_id(world.server.put(claim))
    assert world.kubelet.prepare([c])[c.uid].error == ""
    world.plugin.driver.claim_status.idle()
    got = world.server.get("ResourceClaim", "default", "c1")
    assert got is not None and [d["driver"] for d in got["status"]["devices"]] == [
        "nic.example.com",
        DRIVER,
    ]

    with caplog.at_level(logging.DEBUG, logger="driver.claimstatus"):
        assert world.kubelet.unprepare([c]) == {c.uid: ""}
        world.plugin.driver.claim_status.idle()
    write, remove = world.status_patches()
    assert remove.path == write.path and remove.query["fieldManager"] == [DRIVER]
    assert remove.content_type == "application/apply-patch+yaml"
    got = world.server.get("ResourceClaim", "default", "c1")
    assert got is not None and got["status"]["devices"] == [theirs]  # the other driver's stays
    assert world.plugin.driver.claim_status.removed == 1
    # an unknown claim (not ours, or done already) is not sent anything
    assert world.kubelet.unprepare([c]) == {c.uid: ""}
    world.plugin.driver.claim_status.idle()
    assert len(world.status_patches()) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_unprepare_of_a_claim_deleted_or_created_again_touches_nothing(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="driver.claimstatus")
    gone = claim_id(world.server.put(allocated_claim("gone")))
    again = claim_id(world.server.put(allocated_claim("again")))
    for c in (gone, again):
        assert world.kubelet.prepare([c])[c.uid].error == ""
    world.plugin.driver.claim_status.idle()
    world.server.delete("ResourceClaim", "default", "gone")
    world.server.delete("ResourceClaim", "default", "again")
    # a new claim of the same name, prepared (on another node, say) with its own status
    new = allocated_claim("again")
    new["status"]["devices"] = [{"driver": DRIVER, "pool": NODE, "device": "gpu-0",
                                 "data": {"theirs": True}}]  # fmt: skip
    stored = world.server.put(new)
    assert stored["metadata"]["uid"] != again.uid
    share = stored["status"]["allocation"]["devices"]["results"][0].get("shareID")
    if share:
        new["status"]["devices"][0]["shareID"] = share
        stored = world.server.put(new)
    assert world.kubelet.unprepare([gone, again]) == {gone.uid: "", again.uid: ""}
    world.plugin.driver.claim_status.idle()
    assert len(world.status_patches()) == 4  # two writes, two removals the server refused
    got = world.server.get("ResourceClaim", "default", "again")
    assert got is not None and got["status"]["devices"] == new["status"]["devices"]
    assert [r.getMessage() for r in caplog.records if r.name == "driver.claimstatus"] == []
    assert world.plugin.driver.claim_status.removed == 0

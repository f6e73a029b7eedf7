"""ResourceSlice publishing against the fake API server over real HTTP (kubernetes client)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from driver.backoff import Backoff
from driver.kube import Kube
from driver.publishloop import PublishLoop
from driver.slicebuild import (
    MAX_DEVICES_PER_SLICE,
    build_devices,
    health_map,
    sharing_memory_policy,
)
from driver.slicepublisher import SlicePublisher
from tests.fakes.apiserver import FakeApiServer, parse_quantity, validate_resource_slice
from tests.support.gpu_records import MiB, h100, inventory
from tests.support.slice_publishing import DRIVER, NODE, all_devices, publisher, slices

GiB = 1024**3


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as s:
        s.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield s


def writes(server: FakeApiServer) -> list[str]:
    return [
        f"{r.method} {r.path}"
        for r in server.requests
        if r.method in ("POST", "PUT", "PATCH", "DELETE") and not r.query.get("dryRun")
    ]


def test_sharing_mode_slice_content(server: FakeApiServer) -> None:
    p = publisher(server, "auto")
    assert p.publish(inventory([h100(0), h100(1)]))
    assert p.mode == "sharing"
    [s] = slices(server)
    node_uid = server.get("Node", None, NODE)["metadata"]["uid"]  # type: ignore[index]
    assert s["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": True}
    ]
    assert s["spec"]["nodeName"] == NODE and s["spec"]["driver"] == DRIVER
    assert s["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    d0 = s["spec"]["devices"][0]
    assert d0["name"] == "gpu-0" and d0["allowMultipleAllocations"] is True
    a = d0["attributes"]
    assert a["uuid"] == {"string": h100(0).uuid}
    assert a["index"] == {"int": 0} and a["minor"] == {"int": 0} and a["numaNode"] == {"int": 0}
    assert a["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert a["cudaComputeCapability"] == {"version": "9.0.0"}
    assert a["driverVersion"] == {"version": "550.54.15"}
    assert a["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:18"}
    mem = d0["capacity"]["memory"]
    # 81559Mi is not a multiple of the 256Mi step: max and default round down to 81408Mi.
    assert parse_quantity(mem["value"]) == 81559 * MiB
    assert mem["requestPolicy"] == {
        "default": "81408Mi",
        "validRange": {"min": "256Mi", "max": "81408Mi", "step": "256Mi"},
    }
    assert d0["capacity"]["cores"] == {
        "value": "100",
        "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
    }
    assert s["spec"]["devices"][1]["name"] == "gpu-1"


@pytest.mark.slow
def test_auto_mode_falls_back_to_partition_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="driver.sliceprobe")
    with FakeApiServer(drop_consumable_capacity=True) as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        p = publisher(server, "auto", partitions=4)
        p.publish(inventory([h100(0)]))
        p.publish(inventory([h100(0), h100(1)]))
        assert p.mode == "partition"
        devs = all_devices(server)
        assert [d["name"] for d in devs] == [f"gpu-{i}-slice-{k}" for i in (0, 1) for k in range(4)]
        for d in devs:
            assert "allowMultipleAllocations" not in d
            assert parse_quantity(d["capacity"]["memory"]["value"]) == 81559 * MiB // 4
            assert d["capacity"]["cores"] == {"value": "25"}
        assert devs[5]["attributes"]["partition"] == {"int": 1}
        assert devs[5]["attributes"]["partitionCount"] == {"int": 4}
        # The decision came from a dry-run probe: no sharing-mode slice was ever stored.
        probes = [r for r in server.requests if r.method == "POST" and r.query.get("dryRun")]
        assert len(probes) == 1
        assert [w.split()[0] for w in writes(server)] == ["POST", "PUT"]
    warnings = [r for r in caplog.records if "partition mode" in r.getMessage()]
    assert len(warnings) == 1
    assert "DRAConsumableCapacity" in warnings[0].getMessage()


def test_explicit_partition_mode_with_three_partitions(server: FakeApiServer) -> None:
    p = publisher(server, "partition", partitions=3)
    p.publish(inventory([h100(0, memory=24 * GiB)]))
    devs = all_devices(server)
    assert [d["name"] for d in devs] == ["gpu-0-slice-0", "gpu-0-slice-1", "gpu-0-slice-2"]
    assert parse_quantity(devs[0]["capacity"]["memory"]["value"]) == 8 * GiB
    assert devs[0]["capacity"]["cores"]["value"] == "33"
    # An explicit mode asks the server about device taints only (one dry run), never the mode.
    assert len([r for r in server.requests if r.query.get("dryRun")]) == 1
    assert (p.server_mode, p.probe_.taints) == (None, True)


@pytest.mark.slow
def test_generation_bumps_only_on_change_and_health_taints_device(server: FakeApiServer) -> None:
    p = publisher(server, "sharing")
    gpus = [h100(0), h100(1)]
    assert p.publish(inventory(gpus))
    n = len(writes(server))
    assert not p.publish(inventory(gpus))  # same content: nothing written
    assert len(writes(server)) == n
    assert slices(server)[0]["spec"]["pool"]["generation"] == 1
    assert p.publish(inventory(gpus, unhealthy={gpus[1].uuid: "critical XID 79"}))
    [s] = slices(server)
    assert s["spec"]["pool"]["generation"] == 2
    assert [(d["name"], d.get("taints")) for d in s["spec"]["devices"]] == [
        ("gpu-0", None),
        ("gpu-1", [{"key": f"{DRIVER}/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]),
    ]
    assert validate_resource_slice(s) == []
    assert p.publish(inventory(gpus))  # healthy again: the taint goes
    [s] = slices(server)
    assert s["spec"]["pool"]["generation"] == 3
    assert not any(d.get("taints") for d in s["spec"]["devices"])
    assert p.publish(inventory([h100(0)]))  # gpu-1 gone
    [s] = slices(server)
    assert s["spec"]["pool"]["generation"] == 4
    assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0"]


@pytest.mark.slow
def test_more_than_128_devices_split_into_several_slices(server: FakeApiServer) -> None:
    p = publisher(server, "partition", partitions=4)
    p.publish(inventory([h100(i) for i in range(40)]))  # 160 devices
    ss = slices(server)
    assert [len(s["spec"]["devices"]) for s in ss] == [MAX_DEVICES_PER_SLICE, 32]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in ss} == {2}
    assert {s["spec"]["pool"]["generation"] for s in ss} == {1}
    names = [d["name"] for d in all_devices(server)]
    assert len(names) == len(set(names)) == 160
    p.publish(inventory([h100(i) for i in range(10)]))  # shrinks back to one slice
    [s] = slices(server)
    assert s["spec"]["pool"] == {"name": NODE, "generation": 2, "resourceSliceCount": 1}
    assert len(s["spec"]["devices"]) == 40


def test_no_gpus_is_one_empty_slice(server: FakeApiServer) -> None:
    p = publisher(server, "sharing")
    p.publish(inventory([]))
    [s] = slices(server)
    assert s["spec"].get("devices") in (None, [])
    assert s["spec"]["pool"]["resourceSliceCount"] == 1


@pytest.mark.slow
def test_drift_is_repaired_and_restart_continues_generation(server: FakeApiServer) -> None:
    p = publisher(server, "sharing")
    inv = inventory([h100(0)])
    p.publish(inv)
    name = slices(server)[0]["metadata"]["name"]
    server.delete("ResourceSlice", None, name)
    assert p.publish(inv)
    assert slices(server)[0]["spec"]["pool"]["generation"] == 2
    # A new process (restart) has no memory of what it wrote: it republishes above the old
    # generation, so the scheduler never sees an older generation win.
    p2 = publisher(server, "sharing")
    assert p2.publish(inv)
    assert slices(server)[0]["spec"]["pool"]["generation"] == 3
    assert len(slices(server)) == 1


def test_other_nodes_and_drivers_are_left_alone(server: FakeApiServer) -> None:
    other = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-b-gpu"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-b",
            "pool": {"name": "node-b", "generation": 7, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }
    server.put(other)
    p = publisher(server, "sharing")
    p.publish(inventory([h100(0)]))
    assert p.cleanup() == 1
    assert [s["metadata"]["name"] for s in slices(server)] == ["node-b-gpu"]


def test_missing_node_publishes_without_owner(caplog: pytest.LogCaptureFixture) -> None:
    with FakeApiServer() as server:
        p = publisher(server, "sharing")
        p.publish(inventory([h100(0)]))
        assert "ownerReferences" not in slices(server)[0]["metadata"]
    assert any("Node object not found" in r.getMessage() for r in caplog.records)


def test_memory_policy_rules() -> None:
    for total in (256 * MiB, 511 * MiB, 512 * MiB, 81559 * MiB, 24 * GiB, 15 * GiB + 1):
        policy = sharing_memory_policy(total)
        if total < 512 * MiB:
            assert policy is None
            continue
        assert policy is not None
        top = parse_quantity(policy["default"])
        assert top <= total and top % (256 * MiB) == 0 and total - top < 256 * MiB
        dev = {
            "name": "gpu-0",
            "allowMultipleAllocations": True,
            "capacity": {"memory": {"value": str(total), "requestPolicy": policy}},
        }
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "x"},
            "spec": {
                "driver": DRIVER,
                "nodeName": NODE,
                "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                "devices": [dev],
            },
        }
        assert validate_resource_slice(body) == []


def test_unhealthy_devices_left_out_and_health_map() -> None:
    gpus = [h100(0), h100(1)]
    inv = inventory(gpus, unhealthy={gpus[0].uuid: "critical XID 48"})
    assert [d["name"] for d in build_devices(inv.gpus, "sharing", 4)] == ["gpu-1"]
    hm = health_map(inv, "partition", 2)
    assert hm == {
        "gpu-0-slice-0": "critical XID 48",
        "gpu-0-slice-1": "critical XID 48",
        "gpu-1-slice-0": "",
        "gpu-1-slice-1": "",
    }


@pytest.mark.slow
def test_publish_loop_retries_while_api_down_then_recovers(
    server: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="driver.publishloop")
    loop = PublishLoop(
        publisher(server, "auto"), backoff=Backoff(initial=0.05, factor=2.0, maximum=0.2), resync=60
    )
    modes: list[str] = []
    loop.on_mode = modes.append
    server.down()
    loop.start()
    try:
        inv = inventory([h100(0)])
        loop.submit(inv)
        assert not loop.wait_published(1.0)
        assert not loop.api_reachable
        retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
        assert len(retries) >= 3
        delays = [float(r.getMessage().rsplit("retrying in ", 1)[1].rstrip("s")) for r in retries]
        assert delays[:3] == [0.05, 0.1, 0.2] and max(delays) == 0.2
        server.up()
        assert loop.wait_published(10.0)
        assert loop.api_reachable
        assert modes and modes[-1] == "sharing"
        assert [d["name"] for d in all_devices(server)] == ["gpu-0"]
        assert any("reachable again" in r.getMessage() for r in caplog.records)
        # A later change goes through the same loop.
        inv2 = inventory([h100(0), h100(1)])
        loop.submit(inv2)
        assert loop.wait_published(10.0)
        assert [d["name"] for d in all_devices(server)] == ["gpu-0", "gpu-1"]
    finally:
        loop.stop()


@pytest.mark.slow
def test_publish_loop_resync_repairs_deleted_slice(server: FakeApiServer) -> None:
    loop = PublishLoop(publisher(server, "sharing"), backoff=Backoff(0.05, 2, 0.1), resync=0.2)
    loop.start()
    try:
        loop.submit(inventory([h100(0)]))
        assert loop.wait_published(10)
        name = slices(server)[0]["metadata"]["name"]
        server.delete("ResourceSlice", None, name)
        server.wait_for(lambda s: len(s.objects("ResourceSlice")) == 1, timeout=10, what="resync")
        assert slices(server)[0]["spec"]["pool"]["generation"] == 2
    finally:
        loop.stop()


def test_publish_loop_stop_is_prompt_during_backoff(server: FakeApiServer) -> None:
    loop = PublishLoop(publisher(server, "sharing"), backoff=Backoff(30, 2, 30), resync=60)
    server.down()
    loop.start()
    loop.submit(inventory([h100(0)]))
    threading.Event().wait(0.3)
    done = threading.Event()

    def stop() -> None:
        loop.stop()
        done.set()

    threading.Thread(target=stop, daemon=True).start()
    assert done.wait(5), "stop() waited out the 30 s backoff"


@pytest.mark.slow
def test_long_node_name_gives_valid_unique_slice_names() -> None:
    node = ".".join(["a" * 60] * 4)  # 243 characters, a valid node name
    with FakeApiServer() as server:
        p = SlicePublisher(
            Kube(server.api_client()),
            driver_name=DRIVER,
            node_name=node,
            requested_mode="partition",
            partitions=64,
        )
        p.publish(inventory([h100(0), h100(1), h100(2)]))  # 192 devices: two slices
        names = [s["metadata"]["name"] for s in slices(server)]
        assert len(names) == 2 and all(len(n) <= 253 for n in names)
        assert {s["spec"]["pool"]["name"] for s in slices(server)} == {node}


def test_explicit_sharing_on_a_server_that_drops_fields_errors_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with FakeApiServer(drop_consumable_capacity=True) as server:
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        p = publisher(server, "sharing")
        p.publish(inventory([h100(0)]))
        p.publish(inventory([h100(0), h100(1)]))
        assert p.mode == "sharing"  # the operator's choice stands
        assert [d["name"] for d in all_devices(server)] == ["gpu-0", "gpu-1"]
        assert len([r for r in server.requests if r.query.get("dryRun")]) == 1  # taints only
        assert p.server_mode is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "use --sharing-mode=auto or partition" in errors[0].getMessage()


def test_recreated_node_gets_the_new_owner_uid(server: FakeApiServer) -> None:
    p = publisher(server, "sharing")
    p.publish(inventory([h100(0)]))
    old_uid = slices(server)[0]["metadata"]["ownerReferences"][0]["uid"]
    server.delete("Node", None, NODE)
    new_uid = server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})[
        "metadata"
    ]["uid"]
    # The garbage collector removed the slices owned by the old Node; the next publish repairs.
    assert slices(server) == []
    p.publish(inventory([h100(0)]))
    assert slices(server)[0]["metadata"]["ownerReferences"][0]["uid"] == new_uid != old_uid


def test_auto_reprobes_and_reports_a_changed_server_without_switching(
    server: FakeApiServer,
) -> None:
    p = SlicePublisher(
        Kube(server.api_client()),
        driver_name=DRIVER,
        node_name=NODE,
        requested_mode="auto",
        partitions=4,
        reprobe_interval=0.0,
    )
    p.publish(inventory([h100(0)]))
    assert (p.mode, p.server_mode) == ("sharing", "sharing")
    server.drop_consumable_capacity = True  # the cluster was downgraded / the gate turned off
    p.publish(inventory([h100(0)]))
    assert (p.mode, p.server_mode) == ("sharing", "partition")
    assert [d["name"] for d in all_devices(server)] == ["gpu-0"]  # no switch behind the Driver
    probes = [r for r in server.requests if r.query.get("dryRun")]
    assert len(probes) == 2


def test_use_mode_publishes_the_remembered_mode(server: FakeApiServer) -> None:
    p = publisher(server, "auto")
    p.use_mode("partition")
    p.publish(inventory([h100(0)]))
    assert (p.mode, p.server_mode) == ("partition", "sharing")
    assert [d["name"] for d in all_devices(server)][:1] == ["gpu-0-slice-0"]

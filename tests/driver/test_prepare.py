"""NodePrepareResources/NodeUnprepareResources through the real gRPC sockets, with claims read
by the real kubernetes client from the fake API server over HTTP."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from cdi.schema import validate
from sharing import region
from sharing.limitsfile import parse_limits_file
from tests.driver.kubelet_standin import (
    DRIVER,
    KIND,
    ClaimId,
    result,
    vgpu_config,
)
from tests.driver.plugin_process import fake_gpus
from tests.support.prepare_world import World, close_world, make_world, world

__all__ = ["world"]  # a fixture, used by name

GiB = 1024**3


def test_prepare_sharing_v1_writes_valid_spec_with_limits(world: World) -> None:
    c = world.claim("c1", results=[result("gpu", "gpu-0", memory="4Gi", cores="30")])
    stored = world.server.get("ResourceClaim", "default", "c1")
    assert stored is not None
    share_id = stored["status"]["allocation"]["devices"]["results"][0]["shareID"]

    out = world.kubelet.prepare([c], "v1")

    assert out[c.uid].error == ""
    [dev] = out[c.uid].devices
    assert dev.cdi_device_ids == [f"{KIND}={c.uid}"]
    assert (dev.request_names, dev.pool_name, dev.device_name) == (["gpu"], "node-a", "gpu-0")
    assert dev.share_id == share_id
    spec = world.spec_of(c.uid)
    validate(spec)
    gpu0 = fake_gpus()[0]
    env = world.env_of(c.uid)
    assert env["CUDA_VISIBLE_DEVICES"] == gpu0.uuid
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu0.uuid
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(4 * GiB)
    assert env["CUDA_DEVICE_SM_LIMIT_0"] == "30"
    assert env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == "/run/vgpu-sharing/accounting"
    assert env["VGPU_COMPUTE_POLICY"] == "hard"
    assert env["VGPU_PRIORITY"] == "1"  # the shim's "normal"
    assert env["VGPU_NODE_STATE_DIR"] == "/run/vgpu-node"
    assert env["VGPU_DEMAND_FILE"] == "/run/vgpu-demand"
    data = world.root / "data"
    claim_dir = data / "claims" / c.uid
    demand = data / "node-state" / f"{c.uid}.demand"
    mounts = {m["containerPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}
    expected = {
        "/usr/local/lib/vgpu-sharing/libvgpu.so": (data / "lib" / "libvgpu.so", "ro"),
        "/usr/local/lib/vgpu-sharing/limits": (claim_dir / "limits", "ro"),
        "/etc/ld.so.preload": (data / "lib" / "ld.so.preload", "ro"),
        # the accounting file alone (a single-file mount), never a writable directory
        "/run/vgpu-sharing/accounting": (claim_dir / "shared" / "accounting", "rw"),
        "/run/vgpu-node": (data / "node-state", "ro"),
        "/run/vgpu-demand": (demand, "rw"),
        # the device metadata (KEP-5304) of request "gpu" of claim c1
        f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/c1/gpu/{DRIVER}-metadata.json": (
            claim_dir / "metadata" / "gpu.json",
            "ro",
        ),
    }
    assert {k: (Path(m["hostPath"]), m["options"][0]) for k, m in mounts.items()} == expected
    assert all({"nosuid", "nodev", "bind"} <= set(m["options"]) for m in mounts.values())
    # Modes: DATA is the plugin's; the claim directory and the limits are root's, read-only to
    # others; only the accounting file and the claim's own demand file are writable by
    # container users, and no directory is.

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.lstat().st_mode)

    assert mode(data) == 0o700
    assert mode(claim_dir) == 0o755
    assert mode(claim_dir / "limits") == 0o444
    assert mode(claim_dir / "shared") == 0o755
    assert mode(data / "node-state") == 0o755
    assert mode(demand) == 0o666 and demand.stat().st_size == 0
    assert sorted(p.name for p in claim_dir.iterdir()) == ["limits", "metadata", "shared"]
    assert mode(claim_dir / "metadata") == 0o755
    assert mode(claim_dir / "metadata" / "gpu.json") == 0o444
    limits = parse_limits_file((claim_dir / "limits").read_text())
    assert limits == {
        "CUDA_DEVICE_MEMORY_LIMIT_0": str(4 * GiB),
        "CUDA_DEVICE_SM_LIMIT_0": "30",
        "VGPU_COMPUTE_POLICY": "hard",
        "VGPU_PRIORITY": "1",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/run/vgpu-sharing/accounting",
        "VGPU_NODE_STATE_DIR": "/run/vgpu-node",
        "VGPU_DEMAND_FILE": "/run/vgpu-demand",
    }
    accounting = claim_dir / "shared" / "accounting"
    region.read(accounting)  # pre-created, valid
    assert mode(accounting) == 0o666
    # No /dev/nvidia* on this host: no device nodes in the spec.
    assert "deviceNodes" not in spec["devices"][0]["containerEdits"]


@pytest.mark.slow
def test_prepare_v1beta1_has_no_share_id(world: World) -> None:
    c = world.claim("c1", results=[result("gpu", "gpu-1", memory="1Gi")])
    out = world.kubelet.prepare([c], "v1beta1")
    [dev] = out[c.uid].devices
    assert dev.share_id is None and dev.device_name == "gpu-1"
    env = world.env_of(c.uid)
    # GPU 1 is the container's device 0.
    assert env["CUDA_VISIBLE_DEVICES"] == fake_gpus()[1].uuid
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(GiB)
    assert env["CUDA_DEVICE_SM_LIMIT_0"] == "100"


@pytest.mark.slow
def test_whole_gpu_when_no_consumed_capacity(world: World) -> None:
    c = world.claim("c1", results=[result("gpu", "gpu-0")])
    assert world.kubelet.prepare([c])[c.uid].error == ""
    env = world.env_of(c.uid)
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(80 * GiB)
    assert env["CUDA_DEVICE_SM_LIMIT_0"] == "100"


def test_two_gpus_indexed_in_visible_devices_order(world: World) -> None:
    c = world.claim(
        "c1",
        results=[
            result("a", "gpu-1", memory="2Gi", cores="20"),
            result("b", "gpu-0", memory="3Gi", cores="40"),
        ],
    )
    out = world.kubelet.prepare([c])
    assert [d.device_name for d in out[c.uid].devices] == ["gpu-1", "gpu-0"]
    env = world.env_of(c.uid)
    g0, g1 = fake_gpus()
    assert env["CUDA_VISIBLE_DEVICES"] == f"{g0.uuid},{g1.uuid}"
    assert (env["CUDA_DEVICE_MEMORY_LIMIT_0"], env["CUDA_DEVICE_SM_LIMIT_0"]) == (
        str(3 * GiB),
        "40",
    )
    assert (env["CUDA_DEVICE_MEMORY_LIMIT_1"], env["CUDA_DEVICE_SM_LIMIT_1"]) == (
        str(2 * GiB),
        "20",
    )


@pytest.mark.slow
def test_partition_mode_limits() -> None:
    w = make_world(mode="partition", partitions=4)
    try:
        c = w.claim("c1", results=[result("gpu", "gpu-1-slice-3", share=False)])
        out = w.kubelet.prepare([c])
        assert out[c.uid].error == ""
        env = w.env_of(c.uid)
        assert env["CUDA_VISIBLE_DEVICES"] == fake_gpus()[1].uuid
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(20 * GiB)
        assert env["CUDA_DEVICE_SM_LIMIT_0"] == "25"
        bad = w.claim("c2", results=[result("gpu", "gpu-0-slice-4", share=False)])
        err = w.kubelet.prepare([bad])[bad.uid].error
        assert "gpu-0-slice-4" in err and "0..3" in err
        whole = w.claim("c3", results=[result("gpu", "gpu-0", share=False)])
        assert "partition mode" in w.kubelet.prepare([whole])[whole.uid].error
    finally:
        close_world(w)


def test_device_nodes_only_where_the_host_has_them() -> None:
    w = make_world(dev_nodes=("nvidia1", "nvidiactl"))
    try:
        c = w.claim("c1", results=[result("gpu", "gpu-0"), result("gpu", "gpu-1")])
        assert w.kubelet.prepare([c])[c.uid].error == ""
        spec = w.spec_of(c.uid)
        nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
        assert nodes == [
            {"path": "/dev/nvidia1", "hostPath": str(w.root / "dev" / "nvidia1")},
            {"path": "/dev/nvidiactl", "hostPath": str(w.root / "dev" / "nvidiactl")},
        ]
        assert spec["cdiVersion"] == "0.5.0"  # hostPath needs 0.5.0; podman 4.3 accepts it
        validate(spec)
    finally:
        close_world(w)


def test_configs_class_then_claim_later_wins_other_drivers_ignored(world: World) -> None:
    other = {
        "source": "FromClaim",
        "opaque": {"driver": "gpu.example.com", "parameters": {"anything": ["goes"]}},
    }
    c = world.claim(
        "c1",
        results=[result("gpu", "gpu-0", memory="8Gi")],
        configs=[
            vgpu_config("FromClaim", {"priority": 5}),
            vgpu_config("FromClass", {"computePolicy": "off", "priority": -3}),
            vgpu_config("FromClaim", {"computePolicy": "elastic", "memoryLimitOverride": "6Gi"}),
            vgpu_config("FromClaim", {"computePolicy": "hard"}, requests=["not-this-request"]),
            other,
        ],
    )
    assert world.kubelet.prepare([c])[c.uid].error == ""
    env = world.env_of(c.uid)
    assert env["VGPU_COMPUTE_POLICY"] == "elastic"  # claim over class; request filter honoured
    assert env["VGPU_PRIORITY"] == "5"  # set by a claim config, not overridden later
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(6 * GiB)


@pytest.mark.slow
def test_bad_claims_fail_alone_and_good_ones_succeed(world: World) -> None:
    good = world.claim("good", results=[result("gpu", "gpu-0", memory="1Gi")])
    unallocated = world.claim("unalloc", allocated=False)
    other_node = world.claim("elsewhere", node="node-b")
    other_driver = world.claim(
        "foreign", results=[result("gpu", "gpu-0", driver="gpu.example.com")]
    )
    unknown_field = world.claim(
        "typo", configs=[vgpu_config("FromClaim", {"computePolicyy": "hard"})]
    )
    bad_policy = world.claim("policy", configs=[vgpu_config("FromClass", {"computePolicy": "max"})])
    bad_priority = world.claim("prio", configs=[vgpu_config("FromClaim", {"priority": 142})])
    too_much = world.claim(
        "override",
        results=[result("gpu", "gpu-0", memory="1Gi")],
        configs=[vgpu_config("FromClaim", {"memoryLimitOverride": "2Gi"})],
    )
    no_gpu = world.claim("nogpu", results=[result("gpu", "gpu-7")])
    other_pool = world.claim("pool", results=[result("gpu", "gpu-0", pool="node-b")])
    wrong_uid = ClaimId(good.namespace, good.name, "6b0c1a4e-0000-4000-8000-000000000000")
    missing = ClaimId("default", "missing", "7b0c1a4e-0000-4000-8000-000000000000")
    claims = [good, unallocated, other_node, other_driver, unknown_field, bad_policy,
              bad_priority, too_much, no_gpu, other_pool, wrong_uid, missing]  # fmt: skip

    out = world.kubelet.prepare(claims)

    assert set(out) == {c.uid for c in claims}
    assert out[good.uid].error == "" and out[good.uid].devices
    expect = {
        unallocated.uid: "is not allocated",
        other_node.uid: "allocated for node node-b, not this node node-a",
        other_driver.uid: "no allocation results for driver vgpu.sharing.dev",
        unknown_field.uid: "unknown field 'computePolicyy'",
        bad_policy.uid: "computePolicy 'max' invalid; allowed: hard, elastic, off",
        bad_priority.uid: "priority 142 invalid; allowed: an integer -100..100",
        too_much.uid: "memoryLimitOverride 2.00 GiB exceeds the allocated 1.00 GiB",
        no_gpu.uid: "no GPU with index 7",
        other_pool.uid: "device gpu-0: pool node-b is not this node's pool node-a",
        wrong_uid.uid: f"has UID {good.uid}, the kubelet asked for {wrong_uid.uid}",
        missing.uid: "ResourceClaim default/missing not found",
    }
    for uid, text in expect.items():
        assert text in out[uid].error, (uid, out[uid].error)
        assert out[uid].devices == []
        assert "\n" not in out[uid].error
    # Only the good claim left anything behind.
    assert [p.name for p in world.plugin.cdi_specs()] == [f"k8s.{DRIVER}-claim_{good.uid}.json"]
    assert [p.name for p in world.plugin.claim_dirs()] == [good.uid]


@pytest.mark.slow
def test_repeated_prepare_same_answer_without_api_server(world: World) -> None:
    c = world.claim("c1", results=[result("gpu", "gpu-0", memory="2Gi")])
    first = world.kubelet.prepare([c])
    world.plugin.driver.claim_status.idle()  # the status write of the first prepare is done
    reads = len(world.server.requests)
    world.server.down()  # the API server is gone: the answer must come from the checkpoint
    second = world.kubelet.prepare([c])
    third = world.kubelet.prepare([c], "v1beta1")
    assert first == second
    assert third[c.uid].devices[0].cdi_device_ids == first[c.uid].devices[0].cdi_device_ids
    assert len(world.server.requests) == reads


def test_unprepare_removes_everything_and_is_idempotent(world: World) -> None:
    c = world.claim("c1", results=[result("gpu", "gpu-0", memory="2Gi")])
    world.kubelet.prepare([c])
    assert world.plugin.cdi_specs() and world.plugin.claim_dirs()
    world.server.delete("ResourceClaim", "default", "c1")  # the claim may be gone by now
    assert world.kubelet.unprepare([c]) == {c.uid: ""}
    assert world.plugin.cdi_specs() == [] and world.plugin.claim_dirs() == []
    assert world.plugin.driver.state.prepared() == []
    assert world.kubelet.unprepare([c], "v1beta1") == {c.uid: ""}
    unknown = ClaimId("default", "never", "8b0c1a4e-0000-4000-8000-000000000000")
    assert world.kubelet.unprepare([unknown]) == {unknown.uid: ""}


@pytest.mark.slow
def test_one_claim_one_quota_two_claims_two(world: World) -> None:
    a = world.claim("a", results=[result("gpu", "gpu-0", memory="2Gi")])
    b = world.claim("b", results=[result("gpu", "gpu-0", memory="2Gi")])
    out = world.kubelet.prepare([a, b])
    ids_a = out[a.uid].devices[0].cdi_device_ids
    assert ids_a != out[b.uid].devices[0].cdi_device_ids
    dir_a, dir_b = (
        {m["containerPath"]: m["hostPath"] for m in world.spec_of(x.uid)["devices"][0][
            "containerEdits"]["mounts"]}["/run/vgpu-sharing/accounting"]
        for x in (a, b)
    )  # fmt: skip
    assert dir_a != dir_b
    # Two containers of one pod referencing claim a get the same CDI device, hence one file.
    assert world.kubelet.prepare([a])[a.uid].devices[0].cdi_device_ids == ids_a


@pytest.mark.slow
def test_every_written_spec_validates(world: World) -> None:
    claims = [
        world.claim(f"c{i}", results=[result("gpu", f"gpu-{i % 2}", memory=f"{i + 1}Gi")])
        for i in range(5)
    ]
    out = world.kubelet.prepare(claims)
    assert all(r.error == "" for r in out.values())
    for p in world.plugin.cdi_specs():
        doc = json.loads(p.read_text())
        validate(doc)
        assert doc["kind"] == KIND


@pytest.mark.slow
def test_slow_claim_read_does_not_block_other_claims(world: World) -> None:
    """The API read happens outside the state lock: one claim stuck on a slow API server does
    not hold up the prepare of another pod's claim."""
    import threading

    from driver.claims import ClaimRef, read_claim

    slow = world.claim("slow", results=[result("gpu", "gpu-0", memory="1Gi")])
    fast = world.claim("fast", results=[result("gpu", "gpu-1", memory="1Gi")])
    state = world.plugin.driver.state
    release = threading.Event()
    api = world.server.api_client()

    def reader(ref: ClaimRef) -> dict[str, Any]:
        if ref.name == "slow":
            assert release.wait(20), "never released"
        return read_claim(api, ref)

    state._read = reader
    results: dict[str, Any] = {}
    t = threading.Thread(target=lambda: results.update(world.kubelet.prepare([slow])))
    t.start()
    try:
        out = world.kubelet.prepare([fast])  # would deadlock-wait if the lock were held
        assert out[fast.uid].error == ""
        assert t.is_alive()
    finally:
        release.set()
        t.join(20)
    assert results[slow.uid].error == ""


def test_shim_installed_atomically_and_only_when_changed(tmp_path: Path) -> None:
    from driver.driver import install_shim
    from sharing.paths import shim_library

    lib_dir = tmp_path / "lib"
    target = install_shim(shim_library(), lib_dir)
    assert target.read_bytes() == shim_library().read_bytes()
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    preload = lib_dir / "ld.so.preload"
    assert preload.read_text() == "/usr/local/lib/vgpu-sharing/libvgpu.so\n"
    inode = target.stat().st_ino
    install_shim(shim_library(), lib_dir)
    assert target.stat().st_ino == inode  # unchanged: not rewritten
    newer = tmp_path / "libvgpu-new.so"
    newer.write_bytes(b"\x7fELF a different build")
    held = target.open("rb")  # a container still has the old one open
    install_shim(newer, lib_dir)
    assert target.read_bytes() == newer.read_bytes()
    assert held.read() == shim_library().read_bytes()  # replaced by rename, not rewritten
    held.close()
    assert sorted(p.name for p in lib_dir.iterdir()) == ["ld.so.preload", "libvgpu.so"]

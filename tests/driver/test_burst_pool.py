"""The plugin's burst pool (docs/policy.md, "Memory that bursts and is given back"), through the
real gRPC sockets with the fake API server: the pool file it writes, the grants it computes in
prepare order, the limits file keys and the read-only mount of the pool in a bursting claim's CDI
spec, the grants recomputed at prepare, unprepare and restart; and real processes on the
simulated GPU, run with the claim's CDI mounts, held to request + grant as the plugin moves it.

The plugin's GPUs are the stand-in H100s (80 GiB, as the simulator's default device).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sharing import burstpool
from sharing.claimlayout import CONTAINER_BURST_POOL
from sharing.policy import BUILTIN, Burst
from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support import cdi_exec
from tests.support.burst_world import (
    claim,
    grant_of,
    granted,
    limits_of,
    pool_path,
    prepare,
    spec_path,
)
from tests.support.prepare_world import World, close_world, make_world
from tests.support.shim_ops import parse_ops

GiB = 1024**3
OOM = "2"
BURSTY = replace(BUILTIN, burst=Burst(max_ratio=4, from_claim=True, show_limit=True))


@pytest.fixture
def bworld() -> Iterator[World]:
    w = make_world(rules_for=lambda _g: BURSTY)
    yield w
    close_world(w)


def test_grants_go_oldest_first_and_follow_prepare_and_unprepare(bworld: World) -> None:
    """pool = 80 GiB - the requests; grant_k = min(limit_k - request_k, pool - older grants)."""
    w = bworld
    a = claim(w, "a", "20Gi", "3x")  # may borrow 40 GiB
    prepare(w, a)
    assert granted(w, a) == 40 * GiB  # pool 60
    b = claim(w, "b", "20Gi", "60Gi")  # may borrow 40 GiB too, but is younger
    prepare(w, b)
    assert (granted(w, a), granted(w, b)) == (40 * GiB, 0)  # pool 40
    c = claim(w, "c", "30Gi")  # no burst: its request only shrinks the pool
    prepare(w, c)
    assert (granted(w, a), granted(w, b)) == (10 * GiB, 0)  # pool 10
    assert "VGPU_BURST_POOL" not in limits_of(w, c)
    with burstpool.Pool(pool_path(w)) as p:
        assert p.read_device(0) == (80 * GiB, 0, 70 * GiB, 10 * GiB, 10 * GiB)
    assert w.kubelet.unprepare([a]) == {a.uid: ""}
    assert granted(w, b) == 30 * GiB  # pool 30, b the oldest now
    assert w.kubelet.unprepare([c]) == {c.uid: ""}
    assert granted(w, b) == 40 * GiB  # its whole headroom
    assert w.kubelet.unprepare([b]) == {b.uid: ""}
    with burstpool.Pool(pool_path(w)) as p:
        assert all(p.read_grant(i).state == burstpool.GRANT_FREE  # type: ignore[union-attr]
                   for i in range(burstpool.MAX_GRANTS))  # fmt: skip
        assert p.read_device(0) == (80 * GiB, 0, 0, 80 * GiB, 0)


def test_a_bursting_claims_limits_file_and_spec(bworld: World) -> None:
    w = bworld
    a = claim(w, "a", "4Gi", "2x", showMemoryLimit=True)
    prepare(w, a)
    lim = limits_of(w, a)
    assert lim["CUDA_DEVICE_MEMORY_LIMIT_0"] == str(4 * GiB)
    assert lim["VGPU_MEMORY_BURST_LIMIT_0"] == str(8 * GiB)
    assert lim["VGPU_BURST_POOL"] == CONTAINER_BURST_POOL
    assert lim["VGPU_MEMORY_SHOW_LIMIT"] == "1"
    g = grant_of(w, a)
    assert g is not None and (g.device, g.request, g.limit, g.grant) == (0, 4 * GiB, 8 * GiB,
                                                                         4 * GiB)  # fmt: skip
    mounts = w.spec_of(a.uid)["devices"][0]["containerEdits"]["mounts"]
    (pool,) = [m for m in mounts if m["containerPath"] == CONTAINER_BURST_POOL]
    assert pool["hostPath"] == str(pool_path(w)) and "ro" in pool["options"]
    # a claim that does not burst gets neither the keys nor the mount
    b = claim(w, "b", "4Gi")
    prepare(w, b)
    assert not any(k.startswith("VGPU_BURST") or "SHOW" in k for k in limits_of(w, b))
    assert CONTAINER_BURST_POOL not in str(w.spec_of(b.uid))


def test_the_default_policy_refuses_a_limit_over_grpc() -> None:
    w = make_world()
    try:
        c = claim(w, "a", "4Gi", "2x", source="FromClass")
        err = w.kubelet.prepare([c])[c.uid].error
        assert "memoryLimit 2x: the node's sharing policy allows no bursting" in err, err
        assert "\n" not in err
        assert not w.plugin.cdi_specs()
    finally:
        close_world(w)


def test_a_restart_rewrites_the_pool_file_from_the_checkpoint(bworld: World) -> None:
    """A grant in the file that the checkpoint does not give (a stale or forged one) is gone
    after a restart; the claims' own grants are recomputed."""
    w = bworld
    a = claim(w, "a", "20Gi", "3x")
    b = claim(w, "b", "50Gi")
    prepare(w, a, b)
    assert granted(w, a) == 10 * GiB
    entry = int(limits_of(w, a)["VGPU_BURST_GRANT_0"])
    key = int(limits_of(w, a)["VGPU_BURST_KEY_0"])
    w.plugin.driver.stop()
    with burstpool.Pool(pool_path(w), writable=True) as p:
        p.write_grant(entry, key=key, device=0, state=burstpool.GRANT_OPEN, request=20 * GiB,
                      limit=60 * GiB, grant=40 * GiB)  # fmt: skip
        p.write_grant(entry + 1, key=7, device=0, state=burstpool.GRANT_OPEN, request=1,
                      limit=2, grant=1)  # fmt: skip
    from tests.driver.plugin_process import InProcessPlugin

    again = InProcessPlugin(w.root, w.server.api_client(), rules_for=lambda _g: BURSTY)
    again.driver.start()
    try:
        assert granted(w, a) == 10 * GiB
        with burstpool.Pool(pool_path(w)) as p:
            assert p.read_grant(entry + 1).state == burstpool.GRANT_FREE  # type: ignore[union-attr]
    finally:
        again.driver.stop()
        w.plugin = again  # close_world stops it again: harmless


# ----------------------------------------------------------------- real processes, real mounts


def run_ops(spec: Path, env: dict[str, str], shim_ops: Path, *ops: str) -> subprocess.Popen[str]:
    return cdi_exec.popen(spec, env, [str(shim_ops), *ops])


def until_step(p: subprocess.Popen[str]) -> list[dict[str, str]]:
    """The op lines up to the program's next `step` (or its end)."""
    assert p.stdout is not None
    lines: list[str] = []
    for line in p.stdout:
        if line.strip() == "step":
            break
        lines.append(line)
    return [r for r in parse_ops("".join(lines)) if r["op"] != "step"]


def go(p: subprocess.Popen[str]) -> list[dict[str, str]]:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.flush()
    return until_step(p)


@NO_CONTEXT_MEMORY
def test_a_process_in_a_bursting_claim_is_held_to_request_plus_the_plugins_grant(
    bworld: World, sim_env: dict[str, str], shim_ops: Path
) -> None:
    """A claim of 20 GiB with a limit of 60 GiB, its process started with the claim's CDI mounts:
    it borrows up to its grant (40 GiB, then 20 GiB once a claim of 40 GiB is prepared, then 40
    again once that one is unprepared), read from the plugin's pool file at every allocation."""
    cdi_exec.skip_unless_possible()
    w = bworld
    a = claim(w, "a", "20Gi", "3x")
    prepare(w, a)
    spec = spec_path(w, a)
    p = run_ops(spec, sim_env, shim_ops, "init", "ctx", f"alloc:{45 * GiB}", f"alloc:{20 * GiB}",
                "free", "step", f"alloc:{45 * GiB}", f"alloc:{35 * GiB}", "free", "step",
                f"alloc:{55 * GiB}", f"alloc:{6 * GiB}")  # fmt: skip
    try:
        first = until_step(p)
        # 45 GiB fits request + grant (60), 20 GiB more does not
        assert [r["rc"] for r in first] == ["0", "0", "0", OOM, "0"], (first, p.stderr)
        b = claim(w, "b", "40Gi")
        prepare(w, b)
        assert granted(w, a) == 20 * GiB
        second = go(p)
        assert [r["rc"] for r in second] == [OOM, "0", "0"], second
        assert w.kubelet.unprepare([b]) == {b.uid: ""}
        third = go(p)
        assert [r["rc"] for r in third] == ["0", OOM], third
    finally:
        _out, err = p.communicate(input="\n", timeout=60)
    assert p.returncode == 0, err

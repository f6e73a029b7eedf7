"""Elastic demand between tenants: one tenant's record can cost only that tenant.

Layout as the DRA driver makes it: a node-state directory of root's that no tenant may write,
one demand file per claim, each writable by its own claim only (here by file ownership; under
the driver by a read-only mount of the directory plus a writable mount of the claim's own file).
The attacker runs as an unprivileged user, uses no GPU, and tries every way to cut a
neighbour's elastic share: writing the neighbour's record, adding records, and lying in its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.compute_workload import Result, Workload, at_least, compute_state, demand_file
from tests.support.staging import stage_region_binding

NOBODY = 65534

pytestmark = pytest.mark.slow

ATTACKER = r"""
import os, sys, time
path, mode, uuid_hex, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
from sharing._region_cffi import ffi
f = ffi.new("struct vgpu_demand_file *")
f.magic, f.version, f.ndev = 0x44475056, 2, 64
uuid = bytes.fromhex(uuid_hex)
def entry(i, cap, want):
    ffi.memmove(f.dev[i].uuid, uuid, 16)
    d = f.dev[i].d
    d.slice_id, d.cap_permille, d.policy, d.priority, d.want_until_ns = 99 + i, cap, 2, -100, want
end = time.monotonic() + seconds
while True:
    now = time.monotonic_ns()
    if mode == "garbage":
        data = os.urandom(ffi.sizeof(f[0]))
    else:
        if mode == "lie":  # a believable lie, kept up: I want the whole device, now
            entry(0, 1000, now + 100_000_000)
        elif mode == "out-of-range":  # every entry claims the device, with caps no slice has
            for i in range(16):
                entry(i, 5000, now + 100_000_000)
        elif mode == "stale":  # written once with a want far ahead (or an earlier boot's clock)
            entry(0, 1000, now + 3600 * 10**9)
        data = bytes(ffi.buffer(f))
    with open(path, "r+b") as out:
        out.write(data)
    if time.monotonic() > end:
        break
    time.sleep(0.01)
"""


@pytest.fixture
def node(workload: Workload) -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv: the attacker is an unprivileged user")
    d = Path("/tmp") / f"vgpu-demand-{os.getpid()}"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    (d / "victim.demand").touch(mode=0o644)
    (d / "attacker.demand").touch(mode=0o644)
    os.chown(d / "attacker.demand", NOBODY, NOBODY)
    yield d
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(d.parent / f"{d.name}-py", ignore_errors=True)


def as_nobody(
    *cmd: str, wait: bool = True, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd],
        env=env if env is not None else {"PATH": os.environ.get("PATH", "")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if wait:
        p.wait(timeout=30)
    return p


def victim(workload: Workload, node: Path, seconds: str = "1.2") -> tuple[Result, Any]:
    env = workload.env(
        "victim",
        CUDA_DEVICE_SM_LIMIT="30",
        VGPU_COMPUTE_POLICY="elastic",
        VGPU_NODE_STATE_DIR=str(node),
        VGPU_DEMAND_FILE=str(node / "victim.demand"),
    )
    r = workload.run(env, "--warmup", "0.3", "--seconds", seconds)
    assert r.returncode == 0, r.stderr
    return r, compute_state(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))


def test_a_tenant_cannot_cut_a_neighbours_share(workload: Workload, node: Path) -> None:
    # Alone, the elastic 30% slice takes the whole idle device.
    alone, st = victim(workload, node)
    assert st.effective_permille == 1000 and at_least(alone, 80), alone.share
    own: Any = demand_file(node / "victim.demand")
    uuid = bytes(own.dev[0].uuid).hex()
    assert own.dev[0].d.cap_permille == 300

    # The attacker cannot touch the neighbour's record, nor add records of its own.
    before = (node / "victim.demand").read_bytes()
    w = as_nobody("sh", "-c", f"printf x > {node}/victim.demand")
    assert w.returncode != 0
    w = as_nobody("sh", "-c", f": > {node}/squat.demand")
    assert w.returncode != 0 and not (node / "squat.demand").exists()
    assert (node / "victim.demand").read_bytes() == before

    # What it writes in its own file: garbage, out-of-range claims, a want written once far
    # ahead. None of it is believed: the neighbour still gets the idle device.
    python, py_env = stage_region_binding(node.parent / f"{node.name}-py")
    for mode in ("garbage", "out-of-range", "stale"):
        liar = as_nobody(*python, "-c", ATTACKER, str(node / "attacker.demand"), mode, uuid, "2.5",
                         wait=False, env=py_env)  # fmt: skip
        time.sleep(0.2)
        r, st = victim(workload, node)
        liar.wait(timeout=30)
        assert liar.returncode == 0, liar.stderr
        assert st.effective_permille == 1000 and at_least(r, 80), (mode, r.share)

    # A believable lie about its own demand, kept up: it may hold the neighbour to the
    # neighbour's own cap, never below it.
    liar = as_nobody(*python, "-c", ATTACKER, str(node / "attacker.demand"), "lie", uuid, "2.5",
                     wait=False, env=py_env)  # fmt: skip
    time.sleep(0.2)
    r, st = victim(workload, node)
    liar.wait(timeout=30)
    assert liar.returncode == 0, liar.stderr
    assert st.effective_permille == 300
    assert r.share < 36 and at_least(r, 27), r.share

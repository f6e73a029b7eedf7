"""The compute state in the accounting file, as the Python reader (cffi) sees it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sharing._region_cffi import ffi

from tests.support.compute_workload import Workload, compute_state, demand_file


def test_sizes() -> None:
    # 512 bytes: the size of the placeholder the compute state replaced (region layout unchanged).
    assert ffi.sizeof("struct vgpu_compute_state") == 512
    assert ffi.sizeof("struct vgpu_node_slot") == 32
    # 64 devices (demand layout 2)
    assert ffi.sizeof("struct vgpu_demand_file") == 16 + 64 * (16 + 32)


def _demand(path: Path) -> object:
    return demand_file(path)


@pytest.mark.slow
def test_a_capped_run_leaves_its_accounting(workload: Workload, tmp_path: Path) -> None:
    env = workload.env("acct", CUDA_DEVICE_SM_LIMIT="30", VGPU_PRIORITY="0")
    r = workload.run(env, "--warmup", "0.5", "--seconds", "1")
    assert r.returncode == 0, r.stderr
    data = Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).read_bytes()
    region = ffi.cast("struct vgpu_region *", ffi.from_buffer(data))
    st = region.compute[0]
    assert st.version == 2 and st.effective_permille == 300
    assert st.slice_id != 0 and st.attached == 1
    assert st.launches > 100 and st.measured_launches > 10 and st.throttled > 0
    # Charged device time is the measured cost: 1 ms per launch, within 5%.
    assert abs(st.charged_ns / st.launches - 1_000_000) < 50_000
    assert region.compute[1].version == 0  # device 1 never used
    node = Path(env["VGPU_NODE_STATE_DIR"])
    # The slice's demand record: a file of its own, named by its id, the entry of device 0.
    (demand,) = node.glob("*.demand")
    assert demand.name == f"{st.slice_id:016x}.demand"
    f: Any = _demand(demand)
    assert f.magic == 0x44475056 and f.version == 2 and f.ndev == 64
    e = f.dev[0]
    assert bytes(e.uuid) != bytes(16)
    assert (e.d.slice_id, e.d.cap_permille, e.d.policy, e.d.priority) == (st.slice_id, 300, 1, 0)
    assert all(f.dev[i].d.slice_id == 0 for i in range(1, 64))


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(3))
def test_slices_starting_together_each_have_one_demand_record(
    workload: Workload, tmp_path: Path, round_: int
) -> None:
    # Twelve elastic slices (one of three processes) start at once. Each must end up with one
    # demand record of its own, with its own priority, and the three processes of one slice
    # must share theirs (when demand lived in shared slots, a slot taken but not yet used looked
    # stale to a slice starting at the same moment, which took it over).
    node = tmp_path / f"node-{round_}"
    envs = [
        workload.env(
            f"s{round_}-{i}",
            CUDA_DEVICE_SM_LIMIT="10",
            VGPU_COMPUTE_POLICY="elastic",
            VGPU_PRIORITY=str(i),
            VGPU_NODE_STATE_DIR=str(node),
        )
        for i in range(12)
    ]
    procs = [workload.start(env, "--warmup", "0.2", "--seconds", "0.3") for env in envs]
    procs += [workload.start(envs[0], "--warmup", "0.2", "--seconds", "0.3") for _ in range(2)]
    results = [workload.wait(p) for p in procs]
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]

    ids: dict[int, int] = {}
    for i, env in enumerate(envs):
        st = compute_state(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
        ids[st.slice_id] = i
    assert len(ids) == len(envs) and 0 not in ids
    held = []
    for path in node.glob("*.demand"):
        f: Any = _demand(path)
        d = f.dev[0].d
        assert path.name == f"{d.slice_id:016x}.demand"
        held.append((int(d.slice_id), int(d.priority)))
    assert sorted(held) == sorted(ids.items()), (held, ids)

"""The compute state in the accounting file, as the Python reader (cffi) sees it."""

from __future__ import annotations

from pathlib import Path

from sharing._region_cffi import ffi

from tests.shim_compute.conftest import Workload


def test_sizes() -> None:
    # 512 bytes: the size of the placeholder the compute state replaced (region layout unchanged).
    assert ffi.sizeof("struct vgpu_compute_state") == 512
    assert ffi.sizeof("struct vgpu_node_slot") == 32
    assert ffi.sizeof("struct vgpu_node_file") == 16 + 64 * 32


def test_a_capped_run_leaves_its_accounting(workload: Workload, tmp_path: Path) -> None:
    env = workload.env("acct", CUDA_DEVICE_SM_LIMIT="30", VGPU_PRIORITY="0")
    r = workload.run(env, "--warmup", "0.5", "--seconds", "1")
    assert r.returncode == 0, r.stderr
    data = Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).read_bytes()
    region = ffi.cast("struct vgpu_region *", ffi.from_buffer(data))
    st = region.compute[0]
    assert st.version == 1 and st.cap_permille == 300 and st.policy == 1 and st.priority == 0
    assert st.slice_id != 0 and st.attached == 1
    assert st.launches > 100 and st.measured_launches > 10 and st.throttled > 0
    # Charged device time is the measured cost: 1 ms per launch, within 5%.
    assert abs(st.charged_ns / st.launches - 1_000_000) < 50_000
    assert region.compute[1].version == 0  # device 1 never used
    node = Path(env["VGPU_NODE_STATE_DIR"])
    files = list(node.glob("compute-*.state"))
    assert len(files) == 1
    nf = ffi.cast("struct vgpu_node_file *", ffi.from_buffer(files[0].read_bytes()))
    assert nf.magic == 0x43475056 and nf.nslots == 64
    assert [s.slice_id for s in nf.slots if s.slice_id] == [st.slice_id]

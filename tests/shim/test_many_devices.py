"""Devices past the first 16 of a process are charged and limited like the first; past the
accounting file's bound (region.MAX_DEVICES) memory is refused while a limit is set (fail
closed, one log line), never handed out unlimited."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sharing import region
from tests.support.shim_ops import Held, device_used, run_ops

MiB = 1 << 20
GiB = 1 << 30


def node_of(tmp_path: Path, n: int) -> str:
    cfg = tmp_path / f"sim{n}.json"
    cfg.write_text(json.dumps({"devices": [{"memory": 4 * GiB} for _ in range(n)]}))
    return str(cfg)


def test_bound_is_past_sixteen() -> None:
    assert region.MAX_DEVICES == 64
    assert region.LAYOUT_VERSION >= 5  # 64 devices since layout 5


@pytest.mark.parametrize("ordinal", [16, 17, 40, 63])
def test_device_past_sixteen_is_charged_and_limited(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, ordinal: int
) -> None:
    reg = tmp_path / "slice.region"
    env = dict(
        shim_env,
        SIMGPU_CONFIG=node_of(tmp_path, 64),
        SIMGPU_CONTEXT_MEMORY="0",  # exact allocation bytes; contexts: test_context_memory.py
        CUDA_DEVICE_MEMORY_LIMIT="1Gi",  # every device ...
        **{f"CUDA_DEVICE_MEMORY_LIMIT_{ordinal}": "64Mi"},  # ... and this one less
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg),
    )
    held = Held(
        shim_ops, env, "init", f"ctx:{ordinal}", f"alloc:{48 * MiB}", f"alloc:{32 * MiB}",
        f"async:{8 * MiB}", f"create:{8 * MiB}:{ordinal}", f"create:{2 * MiB}:{ordinal}", "info",
        f"total:{ordinal}",
    )  # fmt: skip
    try:
        assert [r["rc"] for r in held.results] == ["0", "0", "0", "2", "0", "0", "2", "0", "0"]
        assert held.results[-2]["total"] == str(64 * MiB)
        assert held.results[-2]["free"] == "0"
        assert held.results[-1]["total"] == str(64 * MiB)
        snap = region.read(reg)
        assert snap.devices[ordinal].used == 64 * MiB
        assert snap.devices[ordinal].denials == 2
        assert device_used(shim_ops, env, ordinal) == 64 * MiB  # what the driver holds
        assert all(d.used == 0 for d in snap.devices if d.index != ordinal)
    finally:
        held.release()
    assert region.read(reg).devices[ordinal].used == 0


def beyond_env(shim_env: dict[str, str], tmp_path: Path, **extra: str) -> dict[str, str]:
    return dict(
        shim_env,
        SIMGPU_CONFIG=node_of(tmp_path, region.MAX_DEVICES + 2),
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "slice.region"),
        **extra,
    )


def test_device_past_the_bound_is_refused_under_a_limit(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """A context is memory too: under a memory limit none is made on an unaccounted device, so
    nothing there can be allocated (the allocation paths refuse it as well, for a context the
    shim did not see made), and the driver holds nothing on it."""
    last = region.MAX_DEVICES + 1
    env = beyond_env(shim_env, tmp_path, CUDA_DEVICE_MEMORY_LIMIT_0="1Gi")
    held = Held(
        shim_ops, env, "init", f"ctx:{last}", f"create:{2 * MiB}:{last}",
        f"ctx:{region.MAX_DEVICES - 1}", f"alloc:{MiB}",  # the last accounted one: no limit of its own
    )  # fmt: skip
    try:
        # the context and the physical allocation on the unaccounted device: out of memory
        assert [r["rc"] for r in held.results] == ["0", "2", "2", "0", "0"], held.results
        assert device_used(shim_ops, env, last) == 0  # the driver gave it nothing
    finally:
        held.release()
    lines = [x for x in held.stderr.splitlines() if "ordinal" in x]
    assert lines == [
        f"vgpu: device ordinal {last}: memory refused: a memory limit is set and only the first "
        f"{region.MAX_DEVICES} devices of a process are accounted"
    ]


def test_device_past_the_bound_without_limits_is_the_drivers(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """No memory limit (the slice is there for a compute cap only): nothing to enforce."""
    last = region.MAX_DEVICES + 1
    env = beyond_env(shim_env, tmp_path, CUDA_DEVICE_SM_LIMIT="50")
    res = run_ops(shim_ops, env, "init", f"ctx:{last}", f"alloc:{MiB}", "array:64:64", "info")
    assert [r["rc"] for r in res] == ["0"] * 5

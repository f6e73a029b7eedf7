"""The observers' counters in the accounting file: denials in count and bytes, peak,
and the compute gate's launches / charged time / held-back time, read without the lock."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharing import region
from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support.shim_ops import Held, run_ops

pytestmark = NO_CONTEXT_MEMORY


MiB = 1 << 20


def test_denials_count_bytes_and_peak(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    reg = tmp_path / "slice.region"
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="64Mi", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg))
    a = Held(shim_ops, env, "init", "ctx", f"alloc:{40 * MiB}")
    try:
        res = run_ops(
            shim_ops,
            env,
            "init",
            "ctx",
            f"alloc:{32 * MiB}",
            f"alloc:{30 * MiB}",
            f"alloc:{24 * MiB}",
        )
        assert [r["rc"] for r in res[2:]] == ["2", "2", "0"]
        d = region.read(reg).devices[0]
        assert (d.denials, d.denied_bytes) == (2, 62 * MiB)
        assert d.peak == 64 * MiB
    finally:
        a.release()
    d = region.read(reg).devices[0]
    assert d.used == 0 and d.peak == 64 * MiB and d.denied_bytes == 62 * MiB


def test_old_layout_is_refused_by_version_not_size(tmp_path: Path) -> None:
    """A layout-3 file (smaller devices[]) names its version in one line."""
    p = tmp_path / "old.region"
    region.create(p)
    old_size = region.FILE_SIZE - 8 * region.MAX_DEVICES  # layout 3 had no denied_bytes
    data = bytearray(p.read_bytes()[:old_size])
    data[4:8] = (3).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    with pytest.raises(region.RegionError) as e:
        region.read(p)
    msg = str(e.value)
    assert f"layout version 3, this reader knows {region.LAYOUT_VERSION}" in msg
    assert "\n" not in msg

"""driver/contextsize.py: the context size of a GPU model, learned by a real helper process on the
simulated GPU, kept in the data dir, asked once per model (a failure included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from driver.contextsize import (
    CACHE_FILE,
    PROBE_TIMEOUT_S,
    ContextSizes,
    loaded_nvml_dir,
    model_key,
)
from sharing.gpus import GpuInfo
from sharing.paths import sim_lib_dir
from tests.driver.plugin_process import fake_gpus
from tests.sim.simhelp import CONTEXT_MEMORY

PROBE = (
    "import ctypes, json, sys; ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL); import pynvml; "
    "pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); u = pynvml.nvmlDeviceGetUUID(h); "
    "print(u.decode() if isinstance(u, bytes) else u)"
)


@pytest.fixture
def sim_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GpuInfo:
    """The simulated node's GPU 0 (a node of its own under tmp_path), as discovery names it."""
    (tmp_path / "simstate").mkdir()
    monkeypatch.setenv("SIMGPU_STATE", str(tmp_path / "simstate"))
    monkeypatch.delenv("SIMGPU_CONFIG", raising=False)
    nvml = str(sim_lib_dir() / "libnvidia-ml.so.1")
    uuid = subprocess.run([sys.executable, "-c", PROBE, nvml], capture_output=True, text=True,
                          check=True, env=dict(os.environ)).stdout.strip()  # fmt: skip
    return replace(fake_gpus(1)[0], uuid=uuid)


class Counting(ContextSizes):
    """Counts the helpers run; a prepare waits for one as long as the helper may take."""

    probes: int = 0

    def __init__(self, data_dir: Path, **kw: Any) -> None:
        super().__init__(data_dir, **{"wait_s": PROBE_TIMEOUT_S, **kw})

    def _probe(self, gpu: GpuInfo) -> int | None:
        self.probes += 1
        return super()._probe(gpu)


@pytest.mark.slow
def test_learned_by_a_helper_once_and_kept(sim_gpu: GpuInfo, tmp_path: Path) -> None:
    sizes = Counting(tmp_path, lib_dir=sim_lib_dir())
    assert sizes.for_gpus([sim_gpu, sim_gpu]) == [CONTEXT_MEMORY, CONTEXT_MEMORY]
    assert sizes.probes == 1
    cache = tmp_path / CACHE_FILE
    assert json.loads(cache.read_text()) == {model_key(sim_gpu): CONTEXT_MEMORY}
    assert cache.stat().st_mode & 0o777 == 0o644
    # a restarted plugin reads it: no helper
    again = Counting(tmp_path, lib_dir=sim_lib_dir())
    assert again.for_gpus([sim_gpu]) == [CONTEXT_MEMORY] and again.probes == 0


@pytest.mark.slow
def test_a_gpu_the_helper_cannot_measure_is_asked_once(sim_gpu: GpuInfo, tmp_path: Path) -> None:
    other = replace(sim_gpu, uuid="GPU-00000000-0000-4000-8000-000000000099", name="Other")
    sizes = Counting(tmp_path, lib_dir=sim_lib_dir())
    assert sizes.for_gpus([other]) == [None]
    assert sizes.for_gpus([other]) == [None]
    assert sizes.probes == 1
    assert not (tmp_path / CACHE_FILE).exists()


def test_no_cuda_driver_no_helper(tmp_path: Path) -> None:
    sizes = Counting(tmp_path, lib_dir=tmp_path)  # no libcuda.so.1 there
    assert sizes.for_gpus(fake_gpus(1)) == [None]


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    ["{", "[1]", '{"a": "500"}', '{"a": -1}', '{"a": true}'],
    ids=["cut", "list", "string", "negative", "bool"],
)
def test_a_bad_cache_is_ignored(tmp_path: Path, sim_gpu: GpuInfo, text: str) -> None:
    (tmp_path / CACHE_FILE).write_text(text.replace('"a"', json.dumps(model_key(sim_gpu))))
    sizes = Counting(tmp_path, lib_dir=sim_lib_dir())
    assert sizes.for_gpus([sim_gpu]) == [CONTEXT_MEMORY] and sizes.probes == 1


def test_loaded_nvml_dir(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 fd:00 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 fd:00 13 /opt/drv/libnvidia-ml.so.1\n"
        "7f04-7f05 rw-p 00000000 00:00 0\n"
    )
    assert loaded_nvml_dir(maps) == Path("/opt/drv")
    maps.write_text("7f04-7f05 rw-p 00000000 00:00 0 [heap]\n")
    assert loaded_nvml_dir(maps) is None


# A helper that answers only once the test lets it (the file GO exists): no timing involved.
GATED = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.01)\nprint(4096)"


def gated(go: Path) -> tuple[str, ...]:
    return (sys.executable, "-c", GATED.replace("sys.argv[1]", repr(str(go))))


def test_a_prepare_does_not_wait_for_a_slow_helper(tmp_path: Path) -> None:
    gpu = fake_gpus(1)[0]
    (tmp_path / "lib" / "libcuda.so.1").parent.mkdir()
    (tmp_path / "lib" / "libcuda.so.1").touch()
    go = tmp_path / "go"
    sizes = Counting(tmp_path, lib_dir=tmp_path / "lib", wait_s=0.2, helper=gated(go))
    assert sizes.for_gpus([gpu]) == [None]  # not learned yet: the claim's shim measures
    assert sizes.for_gpus([gpu]) == [None] and sizes.probes == 1  # the same helper, still running
    go.touch()
    sizes.wait_s = PROBE_TIMEOUT_S
    assert sizes.for_gpus([gpu]) == [4096] and sizes.probes == 1
    assert json.loads((tmp_path / CACHE_FILE).read_text()) == {model_key(gpu): 4096}


def test_learned_at_start_in_the_background(sim_gpu: GpuInfo, tmp_path: Path) -> None:
    sizes = Counting(tmp_path, lib_dir=sim_lib_dir())
    sizes.learn([sim_gpu])
    sizes.learn([sim_gpu])  # rediscovery of the same model: nothing new
    assert sizes.for_gpus([sim_gpu]) == [CONTEXT_MEMORY] and sizes.probes == 1

"""The PTX the probe hands the driver (the spin kernel, the module-global fill) is accepted by
NVIDIA's own PTX assembler (ptxas of the nvidia-cuda-nvcc wheel the test extras bring) for old
and new GPUs: no GPU here can JIT it, so this is the check that a real driver will compile it."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

from sharing.paths import selftest_probe

ARCHS = ["sm_50", "sm_80", "sm_90"]


def _ptxas() -> Path:
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        p = Path(base) / "cuda_nvcc" / "bin" / "ptxas"
        if p.is_file():
            return p
    pytest.skip("no ptxas: the nvidia-cuda-nvcc wheel (test extras) is not installed")


@pytest.mark.parametrize("what", [["spin"], ["global", str(256 << 20)]])
def test_nvidias_ptxas_accepts_the_probes_ptx(tmp_path: Path, what: list[str]) -> None:
    ptxas = _ptxas()
    ptx = subprocess.run([str(selftest_probe()), "ptx", *what], capture_output=True, text=True,
                         check=True, timeout=30).stdout  # fmt: skip
    src = tmp_path / "probe.ptx"
    src.write_text(ptx)
    for arch in ARCHS:
        r = subprocess.run([str(ptxas), f"-arch={arch}", str(src), "-o", str(tmp_path / f"{arch}.cubin")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0, (arch, r.stderr)
    if what == ["spin"]:
        assert "%globaltimer" in ptx and ".entry sim_arg0ns(.param .u64" in ptx

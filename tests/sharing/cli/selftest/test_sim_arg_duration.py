"""The simulator's kernels whose duration is an argument (docs/simulator.md, sim_arg<K>ns): the
selftest's spin kernel runs the time its parameter asks for, as a global-timer spin does on
hardware. Without the shim, uncapped, a lone process's device can serve at most its wall time,
so N launches of T ns each cannot finish in less than N*T; a simulator that ignored the
parameter would run each in the name's default (10 us) and finish far more launches."""

from __future__ import annotations

import subprocess

import pytest

from sharing.cli.selftest.probe import parse_kv
from sharing.paths import selftest_probe

pytestmark = pytest.mark.slow

SPIN_NS = 5_000_000


@pytest.mark.parametrize("ns", [SPIN_NS, 20 * SPIN_NS])
def test_the_spin_kernel_runs_its_argument(sim_env: dict[str, str], ns: int) -> None:
    env = dict(sim_env, SIMGPU_KERNEL_SPREAD_PCT="0", SIMGPU_KERNEL_TAIL_PPM="0")
    p = subprocess.run([str(selftest_probe()), "spin", "0", str(ns), "1"], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    kv = parse_kv(p.stdout)
    launches, seconds = int(kv["launches"]), float(kv["seconds"])
    assert launches >= 1
    # every launch is one wave (one block per SM): ns of device time each, served in order
    assert launches * ns <= seconds * 1e9, p.stdout

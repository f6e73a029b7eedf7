"""The compute cap with PyTorch: an elementwise-heavy loop (in-place add, mul, relu on a tensor of
16 Mi floats: about 1.2 ms of simulated device time per kernel on the default 132 SMs) and a
matmul-heavy one (8192 x 8192 float GEMMs through cuBLAS: about 150 us per kernel, the simulator's
10 us per wave of its grid), with the simulator's default duration spread and tail, under
`vgpu run --sim --compute C` get C% of the device within 2 points, measured by the driver: the
device time the simulator served the process (simgpuProcessBusyNs) over a window bracketed by
torch.cuda.synchronize(), never the host's clock.

The loop keeps the device's queue full, so a slow or loaded host does not take device time from
it: the simulator's queue is set to 1 s of work (SIMGPU_QUEUE_AHEAD_US; its default of 20 ms paces
launch loops, while a GPU's pushbuffer holds about 1024 launches: over a second of the
elementwise kernels), so the device idles only if the process gets no CPU for a second. The
uncapped runs show it (every bucket of the window busy); each run prints how long it waited for a
CPU (cpu_wait, a fraction of the window). A share short of its cap is a failure, whatever the host did."""

from __future__ import annotations

import re

import pytest

from tests.support.clients import Client, frameworks_python

pytestmark = pytest.mark.slow

NUMEL = 16 << 20
GEMM_N = 8192
# (program mode, its size argument)
WORKLOADS = {"elementwise": str(NUMEL), "matmul-heavy": str(GEMM_N)}
WARMUP_S = "1"
WINDOW_S = "3"
POINTS = 2.0
QUEUE_AHEAD_US = "1000000"


@pytest.fixture
def torch_python() -> str:
    return frameworks_python("torch")


@pytest.fixture
def spread_client(client: Client) -> Client:
    """The simulator's default kernel-duration spread and tail (the fixture pins exact ones), and
    a queue of a second of work."""
    env = {k: v for k, v in client.env.items() if not k.startswith("SIMGPU_KERNEL_")}
    return Client(dict(env, SIMGPU_QUEUE_AHEAD_US=QUEUE_AHEAD_US))


def _share(client: Client, python: str, workload: str, vgpu: list[str]) -> tuple[float, str]:
    out = client.run(
        "torch_client.py",
        workload,
        WARMUP_S,
        WINDOW_S,
        WORKLOADS[workload],
        vgpu=vgpu,
        python=python,
    )
    m = re.search(r"share=([\d.]+)", out)
    assert m, out
    return float(m.group(1)), out


@pytest.mark.parametrize("workload", WORKLOADS)
def test_uncapped_loop_keeps_the_device_busy(
    spread_client: Client, torch_python: str, workload: str
) -> None:
    share, out = _share(spread_client, torch_python, workload, [])
    # every complete 50 ms bucket of the window busy: the host keeps work queued
    assert share > 99.0, out


@pytest.mark.parametrize("cap", [10, 30, 50, 70, 90])
def test_elementwise_loop_gets_its_cap(spread_client: Client, torch_python: str, cap: int) -> None:
    share, out = _share(spread_client, torch_python, "elementwise", ["--compute", str(cap)])
    assert abs(share - cap) <= POINTS, out


@pytest.mark.parametrize("cap", [10, 30, 50, 70, 90])
def test_matmul_loop_gets_its_cap(spread_client: Client, torch_python: str, cap: int) -> None:
    share, out = _share(spread_client, torch_python, "matmul-heavy", ["--compute", str(cap)])
    assert abs(share - cap) <= POINTS, out

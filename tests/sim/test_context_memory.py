"""A context's own device memory (SIMGPU_CONTEXT_MEMORY, default 500 MiB as on an H100): taken by
the primary context and by every created one while it exists, and shown as used by cuMemGetInfo,
by NVML's per-process used memory and by NVML's device memory info, as on hardware."""

from __future__ import annotations

from pathlib import Path

from tests.sim.simhelp import CONTEXT_MEMORY, run_python, write_config

LIFECYCLE = """
import ctypes, os
cu = ctypes.CDLL("libcuda.so.1")
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
def seen(cuda=False):
    procs = {p.pid: p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}
    out = {"device": nv.nvmlDeviceGetMemoryInfo(h).used, "process": procs.get(os.getpid(), 0)}
    if cuda:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        assert cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
        out["cuda"] = total.value - free.value
    return out
out = {}
assert cu.cuInit(0) == 0
out["no context"] = seen()
p, c = ctypes.c_void_p(), ctypes.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(p), 0) == 0
assert cu.cuCtxSetCurrent(p) == 0
out["primary"] = seen(cuda=True)
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(p), 0) == 0
out["primary retained twice"] = seen(cuda=True)
assert cu.cuCtxCreate_v2(ctypes.byref(c), 0, 0) == 0
out["primary and created"] = seen(cuda=True)
assert cu.cuCtxDestroy_v2(c) == 0
out["created destroyed"] = seen()
assert cu.cuDevicePrimaryCtxRelease_v2(0) == 0
out["primary released once"] = seen()
assert cu.cuDevicePrimaryCtxRelease_v2(0) == 0
out["primary released"] = seen()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(p), 0) == 0
out["primary again"] = seen()
assert cu.cuDevicePrimaryCtxReset_v2(0) == 0
out["primary reset"] = seen()
print(json.dumps(out))
"""


def test_contexts_take_their_memory_while_they_exist(sim_env: dict[str, str]) -> None:
    got = run_python(sim_env, LIFECYCLE)
    one, two = CONTEXT_MEMORY, 2 * CONTEXT_MEMORY
    assert got == {
        "no context": {"device": 0, "process": 0},
        "primary": {"device": one, "process": one, "cuda": one},
        "primary retained twice": {"device": one, "process": one, "cuda": one},
        "primary and created": {"device": two, "process": two, "cuda": two},
        "created destroyed": {"device": one, "process": one},
        "primary released once": {"device": one, "process": one},
        "primary released": {"device": 0, "process": 0},
        "primary again": {"device": one, "process": one},
        "primary reset": {"device": 0, "process": 0},
    }


def test_knob_sets_the_size_and_zero_turns_it_off(sim_env: dict[str, str]) -> None:
    for knob, expect in (("300Mi", 300 << 20), ("0", 0)):
        got = run_python(dict(sim_env, SIMGPU_CONTEXT_MEMORY=knob), LIFECYCLE)
        assert got["primary"] == {"device": expect, "process": expect, "cuda": expect}
        assert got["primary reset"] == {"device": 0, "process": 0}


def test_a_context_that_does_not_fit_is_out_of_memory(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    """On a 1 GiB device with 600 MiB contexts the second context cannot be created."""
    cfg = write_config(tmp_path, {"devices": [{"memory": "1Gi"}]})
    env = dict(sim_env, SIMGPU_CONFIG=str(cfg), SIMGPU_CONTEXT_MEMORY="600Mi")
    got = run_python(
        env,
        """
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
p, c = ctypes.c_void_p(), ctypes.c_void_p()
out = [cu.cuDevicePrimaryCtxRetain(ctypes.byref(p), 0), cu.cuCtxCreate_v2(ctypes.byref(c), 0, 0)]
nv.nvmlInit()
out.append(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(0)).used)
print(json.dumps(out))
""",
    )
    assert got == [
        0,
        2,
        600 << 20,
    ]  # CUDA_ERROR_OUT_OF_MEMORY; the first context still holds its own

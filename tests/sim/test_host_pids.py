"""The simulated NVML lists processes by their host PID, as the kernel driver does, also for a
process in a PID namespace of its own (a container's): a watchdog on the host finds it under
/proc. Inside that namespace the process still finds itself (the shim's context measurement)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.shim_ops import Held

LIST = """
import json, pynvml as nv
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
print(json.dumps([[p.pid, p.usedGpuMemory] for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]))
"""


def _listed(env: dict[str, str]) -> dict[int, int]:
    out = subprocess.run([sys.executable, "-c", LIST], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    return {pid: used for pid, used in json.loads(out)}


def _ns_children(pid: int) -> list[int]:
    """The unshare'd program: the child of `unshare --fork`, as the host sees it."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids]


@pytest.fixture
def pid_namespace() -> list[str]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): the process runs in a PID namespace of its own")
    return ["unshare", "--pid", "--fork", "--mount-proc", "--"]


def test_a_process_in_its_own_pid_namespace_is_listed_by_its_host_pid(
    sim_env: dict[str, str], build_c: Callable[..., Path], pid_namespace: list[str]
) -> None:
    ops = build_c("shim_ops.c")
    env = dict(sim_env, SIMGPU_CONTEXT_MEMORY=str(64 << 20))
    boxed = subprocess.Popen(
        [*pid_namespace, str(ops), "init", "ctx", f"alloc:{32 << 20}", "ready", "freeall"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert boxed.stdout is not None
        lines = []
        for line in boxed.stdout:
            if line.strip() == "ready":
                break
            lines.append(line)
        assert lines, boxed.stderr.read() if boxed.stderr else ""
        (host_pid,) = _ns_children(boxed.pid)
        status = Path(f"/proc/{host_pid}/status").read_text()
        ns_pids = next(ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:"))
        assert ns_pids == [str(host_pid), "1"]  # its own namespace: PID 1 there
        # a host process sees it under its host PID, with its context and allocation
        listed = _listed(env)
        assert listed.get(host_pid) == (64 << 20) + (32 << 20), listed
        assert 1 not in listed
        # a host process of its own is listed by its own PID too (its own slot: no translation)
        plain = Held(ops, env, "init", "ctx")
        try:
            listed = _listed(env)
            assert set(listed) == {host_pid, plain.proc.pid}, listed
        finally:
            plain.release()
    finally:
        boxed.communicate("x\n", timeout=60)
    assert boxed.returncode == 0

"""The host's NVML on a simulated node, read from outside the test process: a helper process on
the simulator state of the programs under test (an NVML in the test process keeps the first
simulator state it opened, so two tests in one pytest run could not each read their own). Each call
is one fresh pass, as sharing/observe/nvml_reader.read_nvml makes it (the plugin's and the
watchdog's reader), returned as the same NvmlReading."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from sharing.observe.nvml_reader import GpuProcess, GpuReading, NvmlReading

DEADLINE = 60.0

NVML_SERVER = """
import json, sys
from sharing.observe.nvml_reader import read_nvml
for _ in sys.stdin:
    r = read_nvml()
    gpus = [[g.index, g.uuid, g.memory_total, g.memory_used,
             [[p.pid, p.used_bytes] for p in g.processes]] for g in r.gpus]
    print(json.dumps([r.error, gpus]), flush=True)
"""


class HostNvml:
    """read_nvml() in a helper process on sim_env's simulator state; one pass per call."""

    def __init__(self, sim_env: dict[str, str]) -> None:
        env = {k: v for k, v in sim_env.items() if k != "LD_PRELOAD"}
        self.proc = subprocess.Popen([sys.executable, "-c", NVML_SERVER], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        self._lock = threading.Lock()

    def __call__(self) -> NvmlReading:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            error, gpus = json.loads(self.proc.stdout.readline())
        return NvmlReading(taken=time.monotonic(), error=error, gpus=tuple(
            GpuReading(index=i, uuid=uuid, name="", pci_bus_id="", healthy=True,
                       memory_total=total, memory_used=used,
                       processes=tuple(GpuProcess(pid, held) for pid, held in procs))
            for i, uuid, total, used, procs in gpus
        ))  # fmt: skip

    def used(self, pid: int) -> int:
        """What NVML says the process holds on GPU 0 (0: not listed)."""
        r = self()
        assert not r.error, r.error
        return sum(p.used_bytes for p in r.gpus[0].processes if p.pid == pid)

    def close(self) -> None:
        self.proc.communicate(timeout=DEADLINE)

"""vLLM's offline engine and server as the client tests run them (tests/clients/test_vllm.py,
tests/clients/test_vllm_burst.py): the environment vLLM needs on the simulated GPU, a process
whose output lines are awaited with a deadline, and the memory figures of vLLM's log."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.sim.simhelp import CONTEXT_MEMORY

GiB = 1 << 30
DEADLINE_S = 420.0  # one vLLM process's start and work on 2 busy cores takes 30-130 s


def engine_env(base: dict[str, str], cache: Path, config_root: Path) -> dict[str, str]:
    """`base` (a process on the simulated GPU) with what vLLM needs there: nothing fetched, its
    cache (torch.compile artefacts) in `cache`, its configuration in `config_root`, the engine
    in the program's own process (docs/simulator.md, "vLLM")."""
    return dict(
        base,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(cache),
        VLLM_CONFIG_ROOT=str(config_root),
        # FlashInfer's sampler is JIT-compiled with nvcc and needs cuRAND's headers (a toolkit)
        VLLM_USE_FLASHINFER_SAMPLER="0",
        # the V2 runner counts sampled tokens on the device: on a simulator nothing is counted
        VLLM_USE_V2_MODEL_RUNNER="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )


class Run:
    """A process (its own session) whose output lines are read by a thread; every wait has a
    deadline, after which the whole session is killed and the test fails saying what it waited
    for."""

    def __init__(self, cmd: list[str], env: dict[str, str], what: str) -> None:
        self.what = what
        self.deadline = time.monotonic() + DEADLINE_S
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read after the run; freed with it)
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.out: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def log(self) -> str:
        """What the process printed so far: vLLM logs to standard output, tracebacks go to
        standard error."""
        self.err.seek(0)
        return "".join(self.out) + self.err.read()

    def _fail(self, waiting_for: str) -> None:
        self.kill()
        pytest.fail(
            f"{self.what}: no {waiting_for} within {DEADLINE_S:.0f} s (a generate that never "
            f"returns? docs/simulator.md, vLLM); its output: {self.log()[-6000:]}"
        )

    def expect(self, prefix: str) -> str:
        """The next output line starting with `prefix` (fails at the deadline or at the end)."""
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, self.deadline - time.monotonic()))
            except queue.Empty:
                self._fail(repr(prefix))
            if line is None:
                rc = self.proc.wait()
                pytest.fail(f"{self.what} ended ({rc}) before {prefix!r}: {self.log()[-6000:]}")
            self.out.append(line)
            if line.startswith(prefix):
                return line

    def send(self, text: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def wait(self) -> int:
        try:
            rc = self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._fail("exit")
        while (line := self.lines.get(timeout=10)) is not None:
            self.out.append(line)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def gib(line: str, pattern: str) -> list[float]:
    m = re.search(pattern, line)
    assert m, (pattern, line)
    return [float(x) for x in m.groups()]


def memory_lines(log: str) -> list[str]:
    """vLLM's log lines that state device memory in GiB."""
    return [ln for ln in log.splitlines() if re.search(r"\d GiB", ln) and "] " in ln]


def check_memory_lines(log: str, quota_gib: float) -> dict[str, list[float]]:
    """Every GiB figure of vLLM's memory lines is within the slice; the sizing lines say the
    slice: the device's total is the quota, the utilisation target a fraction of it."""
    lines = memory_lines(log)
    over = [
        ln for ln in lines for x in re.findall(r"([\d.]+) GiB", ln) if float(x) > quota_gib + 0.005
    ]
    assert over == [], over
    found: dict[str, list[float]] = {}
    for ln in lines:
        if "Free memory on device" in ln:
            found["free_total"] = gib(ln, r"Free memory on device \(([\d.]+)/([\d.]+) GiB\)")
            found["desired"] = gib(ln, r"utilization is \(([\d.]+), ([\d.]+) GiB\)")
        elif "Available KV cache memory" in ln:
            found["kv"] = gib(ln, r"Available KV cache memory: ([\d.]+) GiB")
    assert {"free_total", "desired", "kv"} <= set(found), "\n".join(lines) or log[-4000:]
    free, total = found["free_total"]
    assert total == quota_gib and free <= total - CONTEXT_MEMORY / GiB + 0.01, found
    util, desired = found["desired"]
    assert abs(desired - util * quota_gib) < 0.06, found  # 0.9 of the slice, not of the GPU
    assert 0 < found["kv"][0] <= desired, found
    return found

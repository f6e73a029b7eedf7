"""vLLM 0.33.0 (installed by scripts/setup into .venv/frameworks) in a slice of the simulated GPU
under `vgpu run --sim`: offline generate and `vllm serve` answer, every memory figure of vLLM's
log follows the slice, a model larger than the slice stops with torch's own out-of-memory error
while the driver read from outside never holds more than the quota, CUDA graphs with
torch.compile keep to a compute cap, and sleep mode gives the slice's memory back and takes it
again (programs/vllm_client.py).

The model is made up (a config.json written here: Llama, dummy weights, no tokenizer, prompts as
token ids), so nothing is fetched. What vLLM needs of the simulated GPU, and why the tests set
VLLM_USE_FLASHINFER_SAMPLER=0 and VLLM_USE_V2_MODEL_RUNNER=0, is in docs/simulator.md ("vLLM").
The engine runs in the program's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0) except under
`vllm serve`. Every run has a deadline: a generate that never returns (the V2 model runner on a
simulator that computes nothing) fails the test naming the deadline, never hangs it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sharing import region
from sharing.observe.cpuwait import starved, thread_waits_ns
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.clients import FRAMEWORKS_PYTHON, PROGRAMS, Client, frameworks_python
from tests.support.context_storm import Sampler
from tests.support.observers import ExporterProcess, only, scrape_until, value
from tests.support.vllm_model import write_model
from tests.support.vllm_run import GiB, Run, check_memory_lines, engine_env, gib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

QUOTA = 8 * GiB
PROGRAM = str(PROGRAMS / "vllm_client.py")
METRIC = "vgpu_slice_memory_used_bytes"


@pytest.fixture(scope="module")
def vllm_cache() -> Iterator[Path]:
    """vLLM's cache (torch.compile artefacts), shared by the module's runs, removed after."""
    with tempfile.TemporaryDirectory(prefix="vllm-cache-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def vllm_installed() -> None:
    """Once per module: `import vllm` takes 15 s."""
    frameworks_python("vllm")


@pytest.fixture
def vllm_env(
    vllm_installed: None, client: Client, vllm_cache: Path, tmp_path: Path
) -> dict[str, str]:
    return engine_env(client.env, vllm_cache, tmp_path / "vllm-config")


def vgpu(*flags: str) -> list[str]:
    return [sys.executable, "-m", "sharing.cli", "run", "--sim", *flags, "--"]


def test_sleep_gives_the_slice_back_and_wake_up_takes_it(
    vllm_env: dict[str, str], tmp_path: Path, runs: list[Run]
) -> None:
    """One offline engine in an 8 GiB slice generates, sleeps at level 1 (weights offloaded to
    the host, KV cache discarded), wakes, generates, sleeps at level 2 (both discarded), wakes
    and generates again. Each time the device memory goes back to the slice and wake_up() takes
    it again, as the accounting file, `vgpu top --json` and the exporter all say; every memory
    line of vLLM's log follows the slice, and the driver, sampled from outside, never holds more
    than the slice."""
    model = write_model(tmp_path / "model")
    accounting = tmp_path / "slice.region"
    sampler = Sampler(vllm_env, QUOTA)
    run = Run(
        [
            *vgpu("--memory", "8Gi", "--region", str(accounting)),
            str(FRAMEWORKS_PYTHON), PROGRAM, str(model), "sleep", "1,2",
        ],
        vllm_env,
        "vLLM sleep mode, levels 1 and 2",
    )  # fmt: skip
    runs.append(run)
    plain = {k: v for k, v in vllm_env.items() if k != "LD_PRELOAD"}
    observer = ["--sim", "--data-dir", str(tmp_path / "no-plugin"), "--region", str(accounting)]

    def used() -> int:
        """The slice's usage by its accounting file, checked against `vgpu top` and the exporter
        (the engine waits on its stdin, so nothing moves meanwhile)."""
        n = region.read(accounting).used_by_live(0)
        top = subprocess.run(
            [sys.executable, "-m", "sharing.cli", "top", *observer, "--json"],
            env=plain, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert top.returncode == 0, top.stderr
        [dev] = json.loads(top.stdout)["devices"]
        [mine] = [s for s in dev["slices"] if s["claim"] == str(accounting)]
        assert mine["memory_used_bytes"] == n, (mine, n)
        got = scrape_until(
            exporter.url,
            lambda s: [x.value for x in only(s, METRIC, claim=str(accounting))] == [n],
        )
        assert value(got, METRIC, claim=str(accounting)) == n
        return n

    assert run.expect("generated") == "generated n=8\n"
    exporter = ExporterProcess([*observer, "--pod-resources-socket", ""], plain)
    try:
        figures = {"awake before": used()}
        run.send()
        for level in (1, 2):
            assert run.expect("asleep") == f"asleep level={level}\n"
            figures[f"asleep {level}"] = used()
            run.send()
            run.expect("awake")
            figures[f"awake {level}"] = used()
            run.send()
            assert run.expect("generated") == "generated n=8\n"
        assert run.wait() == 0, run.log()[-4000:]
    finally:
        log = exporter.stop()
    assert "Traceback" not in log, log
    sampled = sampler.stop()
    # the KV cache (0.9 of the slice less the context and the weights) is released and taken back
    assert all(0 < x <= QUOTA for x in figures.values()), figures
    assert figures["awake before"] >= 7 * GiB, figures
    for level in (1, 2):
        assert figures[f"asleep {level}"] <= GiB, figures
        assert figures[f"awake {level}"] >= figures["awake before"] - (64 << 20), figures
    said = re.findall(
        r"Sleep mode freed ([\d.]+) GiB memory, ([\d.]+) GiB memory is still", run.log()
    )
    assert len(said) == 2, run.log()[-4000:]
    for level, (freed, kept) in zip((1, 2), said, strict=True):
        asleep = figures[f"asleep {level}"] / GiB
        assert float(freed) + float(kept) <= 8.0 and abs(float(kept) - asleep) < 0.1, (
            said,
            figures,
        )
    check_memory_lines(run.log(), 8.0)
    assert sampled["over"] == 0 and CONTEXT_MEMORY <= sampled["peak"] <= QUOTA, sampled


def test_two_processes_swap_in_one_slice_by_sleeping(
    vllm_env: dict[str, str], tmp_path: Path, runs: list[Run]
) -> None:
    """Two vLLM processes in one 8 GiB slice (two `vgpu run --region` of one accounting file),
    each sized for 0.6 of it: the second starts only once the first sleeps (vLLM's start-up check
    sees the slice's free memory), then they take turns; the driver, read from outside, never
    holds more than the slice."""
    model = write_model(tmp_path / "model")
    accounting = tmp_path / "slice.region"
    sampler = Sampler(vllm_env, QUOTA)

    def start(name: str) -> Run:
        cmd = [
            *vgpu("--memory", "8Gi", "--region", str(accounting)),
            str(FRAMEWORKS_PYTHON), PROGRAM, str(model), "sleep", "1", "0.6",
        ]  # fmt: skip
        run = Run(cmd, vllm_env, f"vLLM {name} swapping")
        runs.append(run)
        return run

    def used() -> int:
        return region.read(accounting).used_by_live(0)

    a = start("A")
    a.expect("generated")
    a_awake = used()
    a.send()
    a.expect("asleep")
    b = start("B")  # fits only because A sleeps: 0.6 of the slice each, and A's context stays
    b.expect("generated")
    both = used()
    b.send()
    b.expect("asleep")
    a.send()
    a.expect("awake")
    a_again = used()
    a.send()
    assert a.expect("generated") == "generated n=8\n"
    assert a.wait() == 0, a.log()[-4000:]
    b.send()
    b.expect("awake")
    b.send()
    assert b.expect("generated") == "generated n=8\n"
    assert b.wait() == 0, b.log()[-4000:]
    sampled = sampler.stop()
    figures = [a_awake, both, a_again]
    # one awake (0.6 of the slice and its context) and one asleep, never both awake
    assert a_awake > 0.6 * QUOTA and all(x <= QUOTA for x in figures), figures
    assert a_awake < both < a_awake + GiB and a_again < a_awake + GiB, figures
    assert sampled["over"] == 0 and sampled["peak"] <= QUOTA, sampled
    # B sized its KV cache from what the slice had free with A asleep, within the slice
    check_memory_lines(b.log(), 8.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def post(url: str, doc: Any) -> Any:
    req = urllib.request.Request(
        url, json.dumps(doc).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def start_server(
    env: dict[str, str], model: Path, vgpu_flags: list[str], runs: list[Run], what: str
) -> tuple[Run, str]:
    """`vllm serve` (eager) in a slice on 127.0.0.1; returns once /health answers."""
    port = free_port()
    vllm = str(FRAMEWORKS_PYTHON.parent / "vllm")
    env = {k: v for k, v in env.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    serve = [
        vllm, "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
        "--max-model-len", "256", "--max-num-seqs", "16",
        # vLLM's default (0.92) asks more than a 4 GiB slice has free beside its 500 MiB context
        "--gpu-memory-utilization", "0.8",
    ]  # fmt: skip
    run = Run([*vgpu(*vgpu_flags), *serve], env, what)
    runs.append(run)
    return run, f"http://127.0.0.1:{port}"


def wait_healthy(run: Run, base: str) -> None:
    while True:  # up when /health answers; the server may still die first
        if run.proc.poll() is not None:
            pytest.fail(f"{run.what} ended ({run.proc.returncode}): {run.log()[-6000:]}")
        if time.monotonic() > run.deadline:
            run._fail("answer on /health")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)


def descendants(pid: int) -> set[int]:
    """pid and every process under it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def most_waited(before: dict[str, int], pid_now: dict[str, int]) -> int:
    """The longest wait for a CPU any one thread added between two `thread_waits_ns`."""
    return max((n - before.get(t, 0) for t, n in pid_now.items()), default=0)


# NVML's per-process samples, read from outside every slice once a second for argv[1] seconds:
# each process's busy percentage of the device over each period, averaged per process.
PROCESS_SHARES = """
import json, sys, time
import pynvml as nv
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
seen, sums, n = 0, {}, 0
try:
    seen = max(s.timeStamp for s in nv.nvmlDeviceGetProcessUtilization(h, 0))
except nv.NVMLError:
    pass
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    time.sleep(1.0)
    try:
        samples = nv.nvmlDeviceGetProcessUtilization(h, seen)
    except nv.NVMLError:
        samples = []
    n += 1
    for s in samples:
        sums[s.pid] = sums.get(s.pid, 0) + s.smUtil
        seen = max(seen, s.timeStamp)
print(json.dumps({str(p): v / n for p, v in sums.items()}))
"""


def test_two_servers_in_two_slices_of_one_gpu(
    vllm_env: dict[str, str], tmp_path: Path, runs: list[Run]
) -> None:
    """`vllm serve` in a 4 GiB / 30% slice and in an 8 GiB / 60% slice of one simulated GPU: each
    sizes its KV cache to its own slice, both answer while the other serves, and their device
    shares, read from outside through NVML's per-process samples, follow their caps within 3
    points (the compute benchmark's bound for two slices): never above, and below only when the
    server's busiest thread spent over a quarter of the window waiting for a CPU (on 2 busy
    cores in CI both servers got 60% of their caps, 18 and 36, the host starving them alike). The GPU has one SM, so every kernel
    takes a wave per block and the eager decode loops ask for more than their caps (with 4 SMs
    the 60% server got 47%: its host, not the cap, held it back)."""
    model = write_model(tmp_path / "model")
    config = tmp_path / "gpu.json"
    config.write_text(json.dumps({"devices": [{"sm_count": 1}]}))
    env = {k: v for k, v in vllm_env.items() if not k.startswith("SIMGPU_KERNEL_")}
    env.update(SIMGPU_CONFIG=str(config), SIMGPU_QUEUE_AHEAD_US="1000000")
    slices = {"4Gi/30": (4.0, 30), "8Gi/60": (8.0, 60)}
    servers = {
        name: start_server(
            env, model, ["--memory", f"{q:.0f}Gi", "--compute", str(c)], runs, f"vllm serve {name}"
        )
        for name, (q, c) in slices.items()
    }
    for run, base in servers.values():
        wait_healthy(run, base)
        got = post(
            f"{base}/v1/completions",
            {"model": str(model), "prompt": [3, 4, 5, 6], "max_tokens": 4, "ignore_eos": True},
        )
        assert len(got["choices"]) == 1 and got["usage"]["completion_tokens"] == 4, got
        assert got["usage"]["prompt_tokens"] == 4, got
    stop = threading.Event()
    answered = {name: 0 for name in servers}
    errors: list[str] = []

    def load(name: str, base: str) -> None:
        doc = {"model": str(model), "prompt": [3, 4, 5, 6], "max_tokens": 64, "ignore_eos": True}
        while not stop.is_set():
            try:
                got = post(f"{base}/v1/completions", doc)
                answered[name] += got["usage"]["completion_tokens"] == 64
            except (urllib.error.URLError, OSError, KeyError) as e:
                errors.append(f"{name}: {e}")
                return

    threads = [
        threading.Thread(target=load, args=(name, base), daemon=True)
        for name, (_, base) in servers.items()
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(3)  # the loops fill both servers' batches
        plain = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
        pids = set().union(*(descendants(run.proc.pid) for run, _ in servers.values()))
        before = {pid: thread_waits_ns(pid) for pid in pids}
        window = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-c", PROCESS_SHARES, "8"],
            env=plain, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        window = time.monotonic() - window
        waited = {pid: most_waited(was, thread_waits_ns(pid)) for pid, was in before.items()}
        assert r.returncode == 0, r.stderr
        by_pid = {int(p): v for p, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=90)
    assert errors == [], errors
    shares = {
        name: sum(v for p, v in by_pid.items() if p in descendants(run.proc.pid))
        for name, (run, _) in servers.items()
    }
    assert all(answered.values()), answered
    for run, _ in servers.values():
        os.killpg(run.proc.pid, signal.SIGINT)
    for name, (run, _) in servers.items():
        run.wait()
        check_memory_lines(run.log(), slices[name][0])
    # The cap holds whatever the host does. Short of it, the server's launching thread must have
    # been kept off a CPU (two engines, two API servers and the load on two cores): a server
    # that launches nothing for want of a CPU says nothing about its cap.
    for name, (run, _) in servers.items():
        cap = slices[name][1]
        assert shares[name] <= cap + 3, (shares, by_pid, answered)
        if shares[name] < cap - 3:
            gpu = [p for p in by_pid if p in descendants(run.proc.pid)]
            wait_s = max((waited.get(p, 0) for p in gpu), default=0) / 1e9
            assert starved(wait_s, window), (name, shares, by_pid, wait_s, window)
            warnings.warn(
                f"{name}: {shares[name]:.1f}% short of its cap on a starved host "
                f"(its busiest thread waited {wait_s:.1f} s of {window:.1f} s for a CPU)",
                stacklevel=1,
            )


def test_a_model_larger_than_the_slice_meets_torchs_oom_and_the_driver_never_sees_more(
    vllm_env: dict[str, str], tmp_path: Path, runs: list[Run]
) -> None:
    # 16 layers of 2048 x 8192: about 2.4 GB of bf16 weights for a 2 GiB slice
    model = write_model(
        tmp_path / "big", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16,
    )  # fmt: skip
    quota = 2 * GiB
    sampler = Sampler(vllm_env, quota)
    run = Run(
        # half the slice: vLLM's own start-up check (free memory against the target) passes
        [*vgpu("--memory", "2Gi"), str(FRAMEWORKS_PYTHON), PROGRAM, str(model), "generate", "0.5"],
        vllm_env,
        "vLLM on a model larger than its slice",
    )
    runs.append(run)
    rc = run.wait()
    sampled = sampler.stop()
    log = run.log()
    assert rc != 0 and "generated" not in "".join(run.out), log[-4000:]
    assert "Failed to load model - not enough GPU memory" in log, log[-6000:]  # vLLM's words
    m = re.search(r"torch\.OutOfMemoryError: CUDA out of memory\..*", log)
    assert m, log[-6000:]
    assert "total capacity of 2.00 GiB" in m.group(0), m.group(0)
    assert sampled["over"] == 0 and CONTEXT_MEMORY <= sampled["peak"] <= quota, sampled


CAP = 30
POINTS = 2.0
# A GPU of 8 SMs: the model's kernels take several waves each, so its decode loop keeps the
# device about 90% busy uncapped (measured on 2 busy cores), well above the cap.
SMALL_GPU = {"devices": [{"sm_count": 8}]}


def test_cuda_graphs_and_torch_compile_keep_to_a_compute_cap(
    vllm_env: dict[str, str], tmp_path: Path, runs: list[Run]
) -> None:
    model = write_model(tmp_path / "model")
    config = tmp_path / "gpu.json"
    config.write_text(json.dumps(SMALL_GPU))
    # the simulator's default duration spread and tail, and a second of queued work (as
    # tests/clients/test_torch_compute.py)
    env = {k: v for k, v in vllm_env.items() if not k.startswith("SIMGPU_KERNEL_")}
    env.update(SIMGPU_CONFIG=str(config), SIMGPU_QUEUE_AHEAD_US="1000000")
    run = Run(
        [
            *vgpu("--memory", "8Gi", "--compute", str(CAP)),
            str(FRAMEWORKS_PYTHON), PROGRAM, str(model), "graphs", "3", "5",
        ],
        env,
        "vLLM with CUDA graphs under a compute cap",
    )  # fmt: skip
    runs.append(run)
    out = run.expect("share=")
    assert run.wait() == 0, run.log()[-4000:]
    log = run.log()
    # the decode steps ran as CUDA graphs of a torch.compile'd model
    assert re.search(r"torch\.compile took [\d.]+ s", log), log[-4000:]
    assert "Graph capturing finished" in log, log[-4000:]
    share = float(gib(out, r"share=([\d.]+)")[0])
    assert share <= CAP + POINTS, out
    if share < CAP - POINTS:
        window, wait = gib(out, r"window_s=([\d.]+) cpu_wait=([\d.]+)")
        assert starved(wait * window, window), out
        warnings.warn(f"{out.strip()}: short of the cap on a starved host", stacklevel=1)

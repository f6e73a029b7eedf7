"""One quota for all processes of a slice: shared through the region file, exact under
concurrency, robust to processes killed at any instant."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from sharing import region
from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support.shim_ops import Held, device_used, parse_ops, run_ops

pytestmark = NO_CONTEXT_MEMORY


MiB = 1 << 20


def test_processes_share_one_quota(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    reg = tmp_path / "slice.region"
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="64Mi", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg))
    a = Held(shim_ops, env, "init", "ctx", f"alloc:{40 * MiB}")
    try:
        res = run_ops(
            shim_ops, env, "init", "ctx", "info", f"alloc:{32 * MiB}", f"alloc:{24 * MiB}"
        )
        assert res[2]["free"] == str(24 * MiB) and res[2]["total"] == str(64 * MiB)
        assert [r["rc"] for r in res[3:]] == ["2", "0"]
        snap = region.read(reg)
        assert [p.used[0] for p in snap.processes if p.alive] == [40 * MiB]
    finally:
        a.release()
    assert region.read(reg).devices[0].used == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("page", "per_thread"), [(512, 30_000), (64 << 10, 30_000), (2 << 20, 100_000)],
    ids=["512B", "64KiB", "2MiB"],
)  # fmt: skip
def test_concurrent_processes_and_threads_never_exceed(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, page: int, per_thread: int
) -> None:
    """4 processes x 8 threads of random allocations and frees against one quota, with a driver
    taking memory in 512 B granules, 64 KiB or 2 MiB pages. The simulated device has exactly the
    quota's memory: had the slice ever exceeded the quota, the simulator itself would have refused
    an allocation the shim let through (more OOMs than shim denials)."""
    quota = 256 * MiB
    cfg = tmp_path / "sim.json"
    cfg.write_text(json.dumps({"devices": [{"name": "NVIDIA H100 80GB HBM3", "memory": quota}]}))
    reg = tmp_path / "slice.region"
    env = dict(
        shim_env,
        SIMGPU_CONFIG=str(cfg),
        CUDA_DEVICE_MEMORY_LIMIT=str(quota),
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg),
        SIMGPU_ALLOC_GRANULARITY=str(page),
    )
    procs = [
        subprocess.Popen(
            [str(shim_ops), "init", "ctx", f"stress:8:{per_thread}:{16 * MiB}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    samples = []
    while any(p.poll() is None for p in procs):
        if reg.exists():  # created by the first process's first allocation
            samples.append(region.read(reg).devices[0].used)
        time.sleep(0.01)
    ok = oom = 0
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        r = parse_ops(out)[-1]
        assert r["other"] == "0", r
        ok += int(r["ok"])
        oom += int(r["oom"])
    snap = region.read(reg)
    assert ok > per_thread and oom > 0  # many allocations, and the quota was reached
    assert oom == snap.devices[0].denials  # every OOM was the shim's; the driver never refused
    assert snap.devices[0].peak <= quota and max(samples) <= quota
    assert snap.devices[0].used == 0
    assert device_used(shim_ops, env) == 0


def test_sigkill_loop_while_others_allocate(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    reg = tmp_path / "slice.region"
    quota = 128 * MiB
    env = dict(
        shim_env, CUDA_DEVICE_MEMORY_LIMIT=str(quota), CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg)
    )
    workers = [
        subprocess.Popen(
            [str(shim_ops), "init", "ctx", f"stress:4:20000:{8 * MiB}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for i in range(25):
        victim = subprocess.Popen(
            [str(shim_ops), "init", "ctx", f"stress:4:100000000:{8 * MiB}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.02 + 0.01 * (i % 4))
        victim.kill()
        victim.wait(timeout=30)
    for w in workers:
        out, err = w.communicate(timeout=300)  # no hang
        assert w.returncode == 0, err
        assert parse_ops(out)[-1]["other"] == "0"
    # the next allocation of anyone returns what the dead held: the whole quota is available
    res = run_ops(shim_ops, env, "init", "ctx", f"alloc:{quota}", "info")
    assert res[2]["rc"] == "0", res
    assert res[3]["free"] == "0"
    assert region.read(reg).devices[0].used == 0  # and all of it returned once that one exited
    assert device_used(shim_ops, env) == 0


def test_killed_process_memory_returns_at_next_allocation(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    reg = tmp_path / "slice.region"
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="64Mi", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg))
    a = Held(shim_ops, env, "init", "ctx", f"alloc:{60 * MiB}")
    a.kill()
    assert region.read(reg).devices[0].used == 60 * MiB  # not yet reclaimed
    res = run_ops(shim_ops, env, "init", "ctx", f"alloc:{60 * MiB}")
    assert res[2]["rc"] == "0"


def test_64_processes_start_at_once(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """64 processes of one slice starting at once: every one sets up, claims a slot of its own
    and is charged exactly once, and none had to take the accounting lock over from another (a
    start that waited on a stuck neighbour would). How long set-up takes under such a start is
    measured, not asserted: benchmarks/bench_shim_memory.py, BENCHMARKS.md."""
    reg = tmp_path / "slice.region"
    env = dict(
        shim_env,
        CUDA_DEVICE_MEMORY_LIMIT="1Gi",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg),
        LIBCUDA_LOG_LEVEL="4",
        SIMGPU_CONTEXT_MEMORY="0",
    )
    procs = [
        subprocess.Popen(
            [str(shim_ops), "init", "ctx", f"alloc:{MiB}", "ready", "freeall"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(64)
    ]
    try:
        for p in procs:  # every one is up and holds its MiB before any lets go
            assert p.stdout is not None
            lines = []
            for line in p.stdout:
                if line.strip() == "ready":
                    break
                lines.append(line)
            assert [r["rc"] for r in parse_ops("".join(lines))] == ["0", "0", "0"], lines
        snap = region.read(reg)
        live = [x for x in snap.processes if x.alive]
        assert sorted(x.pid for x in live) == sorted(p.pid for p in procs)
        assert len({x.slot for x in live}) == 64
        [each] = {x.used[0] for x in live}  # one MiB as the driver takes it (its page)
        assert each >= MiB and snap.devices[0].used == snap.used_by_live(0) == 64 * each
        assert snap.lock_recoveries == 0
    finally:
        errs = [p.communicate(timeout=60)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    assert sum(1 for e in errs for x in e.splitlines() if x.startswith("vgpu: setup took")) == 64
    assert not [x for e in errs for x in e.splitlines() if "taken over" in x]


def test_fork_child_does_not_keep_the_parent_alive(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """The child of a fork closes the inherited region descriptor: its parent's slot dies with
    the parent even while the child lives on."""
    reg = tmp_path / "slice.region"
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="64Mi", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg))
    parent = Held(shim_ops, env, "init", "ctx", f"alloc:{40 * MiB}", "fork")
    child = int(parent.results[-1]["child"])
    parent.kill()
    state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state in "RSD"  # the child still runs (not a zombie)
    res = run_ops(shim_ops, env, "init", "ctx", f"alloc:{60 * MiB}")
    assert res[2]["rc"] == "0"

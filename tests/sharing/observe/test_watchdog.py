"""The watchdog catches processes the shim cannot see: a real program that loads a renamed copy
of the driver (a second driver instance the preloaded shim never hooked) and a GPU process of
no slice, attributed from outside (/proc/<pid>/environ + /proc/<pid>/root)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from sharing import burstpool, region
from sharing.claimlayout import BURST_POOL_FILE, CONTAINER_ACCOUNTING, CONTAINER_BURST_POOL
from sharing.counters import read_counters
from sharing.limitsfile import BurstLimit, render_limits_file
from sharing.observe.nodeview import (
    DeviceView,
    NodeView,
    SliceDeviceView,
    ViewBuilder,
    ViolationCounts,
)
from sharing.observe.nvml_reader import GpuProcess, GpuReading, NvmlReading
from sharing.observe.procinfo import attribute, missing_shim, start_time
from sharing.observe.slices import SliceFinder, region_slice
from sharing.observe.watchdog import Watchdog, _stop
from sharing.paths import shim_library
from sharing.region import read_slot_limits
from tests.sim.simhelp import CONTEXT_MEMORY, NO_CONTEXT_MEMORY
from tests.support.compute_workload import Workload
from tests.support.host_nvml import HostNvml
from tests.support.observers import ExporterProcess, MiB, only, region_with_limits, scrape
from tests.support.shim_ops import Held


def start_bypass(program: Path, env: dict[str, str], nbytes: int) -> subprocess.Popen[str]:
    """tests/c/bypass_copy.c holding nbytes; returns once it holds them."""
    p = subprocess.Popen([str(program), str(nbytes)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "held rc=0", (line, p.stderr.read() if p.stderr else "")
    return p


def start_holder(acct: Path) -> subprocess.Popen[str]:
    """A process of the slice with the shim mapped and the accounting file open, returned once
    it has opened it (it says so on stdout; polling its /proc fd table raced with the
    interpreter's own short-lived descriptors)."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         f"import time; f = open({str(acct)!r}, 'rb'); print('open', flush=True); time.sleep(60)"],
        env=dict(os.environ, LD_PRELOAD=str(shim_library())),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline() == "open\n"
    return holder


def _violations(url: str, claim: str) -> float:
    got = only(scrape(url), "vgpu_slice_quota_violations_total", claim=claim)
    return got[0].value if got else 0.0


def _wait(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_process_bypassing_the_shim_is_caught_and_stopped(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path]
) -> None:
    ops = build_c("shim_ops.c")
    acct = tmp_path / "slice.region"
    region_with_limits(acct, CONTEXT_MEMORY + 256 * MiB)  # a context and 256 MiB
    exp = ExporterProcess(
        ["--sim", "--data-dir", str(tmp_path / "none"), "--region", str(acct),
         "--enforce", "kill", "--watchdog-margin", "16Mi"],
        sim_env,
    )  # fmt: skip
    try:
        # within its quota, through the shim: no violation
        inside = dict(sim_env, LD_PRELOAD=str(shim_library()),
                      CUDA_DEVICE_MEMORY_SHARED_CACHE=str(acct))  # fmt: skip
        ok = Held(ops, inside, "init", "ctx", f"alloc:{200 * MiB}")
        time.sleep(2.5)  # two NVML passes
        assert _violations(exp.url, str(acct)) == 0
        ok.release()
        # the slice's environment and the shim preloaded, but a renamed copy of the driver loaded,
        # out of the shim's reach: the driver grants all 512 MiB (and its context)
        bypass = start_bypass(build_c("bypass_copy.c"), inside, 512 * MiB)
        assert _wait(lambda: _violations(exp.url, str(acct)) == 1)
        # --enforce kill: SIGTERM (the program does not catch it)
        assert bypass.wait(20) == -signal.SIGTERM
        time.sleep(2.5)
        assert _violations(exp.url, str(acct)) == 1  # one episode, counted once
    finally:
        log = exp.stop()
    lines = [line for line in log.splitlines() if "quota violation" in line]
    assert len(lines) == 1, log
    assert f"pid {bypass.pid}" in lines[0] and "over its quota" in lines[0]
    assert f"stopping pids [{bypass.pid}]" in log


@pytest.mark.slow
def test_a_gpu_process_of_no_slice_on_a_shared_gpu(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path]
) -> None:
    ops = build_c("shim_ops.c")
    acct = tmp_path / "slice.region"
    region_with_limits(acct, 1 << 30)
    exp = ExporterProcess(
        ["--sim", "--data-dir", str(tmp_path / "none"), "--region", str(acct)], sim_env
    )
    try:
        stray = Held(ops, sim_env, "init", "ctx", f"alloc:{64 * MiB}")
        try:
            assert _wait(lambda: _violations(exp.url, "") == 1)
            assert stray.proc.poll() is None  # enforce none: counted and logged, not stopped
            assert _violations(exp.url, str(acct)) == 0
        finally:
            stray.release()
    finally:
        log = exp.stop()
    assert f"pid {stray.proc.pid}" in log and "belongs to no slice" in log, log


def test_processes_it_cannot_see_are_never_violations(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the host's PID namespace NVML's PIDs are not in our /proc: no false alarm, no kill."""
    acct = tmp_path / "slice.region"
    region_with_limits(acct, 1 << 30)
    counters = read_counters(str(acct), 1)
    sl = region_slice(str(acct))
    gpu = GpuReading(0, "GPU-x", "m", "p", True, 80 << 30, 8 << 30, 0.5,
                     (GpuProcess(4242, 4 << 30), GpuProcess(4243, 1 << 30)))  # fmt: skip
    sv = SliceDeviceView(sl, 0, counters.devices[0], 1 << 30, 0.0, 0.0, 0, 0)
    view = NodeView((DeviceView(gpu, (sv,), 0),), (), {sl.key: counters})
    empty_proc = tmp_path / "proc"
    empty_proc.mkdir()
    counts = ViolationCounts()
    wd = Watchdog(counts, enforce="kill", proc_root=str(empty_proc))
    with caplog.at_level("WARNING"):
        wd.check(view, NvmlReading(taken=0.0, gpus=(gpu,)))
        wd.check(view, NvmlReading(taken=1.0, gpus=(gpu,)))
    assert counts.unattributed("GPU-x") == 0 and counts.slice(sl.key, 0) == 0
    blind = [r for r in caplog.records if "cannot inspect GPU process" in r.getMessage()]
    assert len(blind) == 1  # said once


def test_a_process_that_exits_before_its_attribution_is_no_violation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NVML lists a process that exits before the watchdog reads its /proc files (a zombie: its
    environment reads ESRCH). Before, that was an unattributed violation, stopped with kill."""
    acct = tmp_path / "slice.region"
    region_with_limits(acct, 1 << 30)
    counters = read_counters(str(acct), 1)
    sl = region_slice(str(acct))
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{zombie.pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        gpu = GpuReading(0, "GPU-x", "m", "p", True, 80 << 30, 8 << 30, 0.5,
                         (GpuProcess(zombie.pid, 1 << 30),))  # fmt: skip
        sv = SliceDeviceView(sl, 0, counters.devices[0], 1 << 30, 0.0, 0.0, 0, 0)
        view = NodeView((DeviceView(gpu, (sv,), 0),), (), {sl.key: counters})
        counts = ViolationCounts()
        wd = Watchdog(counts, enforce="kill")
        with caplog.at_level("WARNING"):
            wd.check(view, NvmlReading(taken=0.0, gpus=(gpu,)))
        assert counts.unattributed("GPU-x") == 0
        assert not [r for r in caplog.records if "quota violation" in r.getMessage()]
    finally:
        zombie.wait()


@pytest.mark.parametrize(
    ("policy", "sm_util", "violation"),
    [("hard", 90, True), ("hard", 35, False), ("elastic", 90, False), ("off", 100, False)],
)
def test_a_slice_over_its_compute_cap_by_nvml_is_a_violation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str, sm_util: int, violation: bool
) -> None:
    """Issue 33, attack 2: a tenant that lifts its cap inside its process (a forged limits file,
    a patched shim) is seen from outside: NVML's per-process SM utilisation of the slice's
    processes, over the window, against the cap (30% + a 10-point margin). An elastic slice
    alone on the device may take the idle time; `off` (an admin's choice) is not checked."""
    acct = tmp_path / "slice.region"
    region_with_limits(acct, 1 << 30, sm=30)
    limits = Path(f"{acct}.limits")
    limits.write_text(
        limits.read_text().replace("VGPU_COMPUTE_POLICY=hard", f"VGPU_COMPUTE_POLICY={policy}")
    )
    counters = read_counters(str(acct), 1)
    sl = region_slice(str(acct))
    # a process of the slice with the shim mapped (so only its compute is in question)
    holder = start_holder(acct)
    try:
        ratio = 0.3 if policy != "off" else 0.0  # slice_limits: no ratio for `off`
        sv = SliceDeviceView(sl, 0, counters.devices[0], 1 << 30, ratio, 0.0, 0, 0)
        counts = ViolationCounts()
        wd = Watchdog(counts, enforce="kill", kill_grace=1.0)
        with caplog.at_level("WARNING"):
            for second in range(12):  # one NVML pass a second
                gpu = GpuReading(0, "GPU-x", "m", "p", True, 80 << 30, 1 << 30, 0.9,
                                 (GpuProcess(holder.pid, 0, sm_util),))  # fmt: skip
                view = NodeView((DeviceView(gpu, (sv,), 0),), (), {sl.key: counters})
                wd.check(view, NvmlReading(taken=float(second), gpus=(gpu,)))
        lines = [
            r.getMessage() for r in caplog.records if "compute cap violation" in r.getMessage()
        ]
        if violation:
            assert len(lines) == 1, lines  # one episode, one line
            assert f"used {sm_util}% of GPU GPU-x's SMs" in lines[0] and "hard cap 30%" in lines[0]
            assert f"pid {holder.pid}" in lines[0]
            assert counts.slice(sl.key, 0) == 1
            assert holder.wait(10) != 0  # stopped (enforce kill)
        else:
            assert lines == []
            assert counts.slice(sl.key, 0) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.communicate()  # closes its stdout


def test_nvml_reader_reports_each_processs_sm_utilisation(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path]
) -> None:
    """What the compute check reads: NVML's per-process SM utilisation (the simulated driver
    reports it as a driver does), through the observers' reader (sharing/observe/nvml_reader.py)."""
    w = Workload(build_c("compute_workload.c"), sim_env, tmp_path)
    busy = w.start(w.env(shim=False), "--warmup", "0", "--seconds", "6")
    try:
        time.sleep(2.5)
        code = (
            "import json; from sharing.observe.nvml_reader import read_nvml; r = read_nvml(); "
            "print(json.dumps([[p.pid, p.sm_util] for g in r.gpus for p in g.processes]))"
        )
        out = subprocess.run([sys.executable, "-c", code], env=sim_env, capture_output=True,
                             text=True, timeout=60, check=True)  # fmt: skip
        got = dict(json.loads(out.stdout))
        assert busy.pid in got, (busy.pid, got)
        assert got[busy.pid] is not None and got[busy.pid] > 50, got  # it runs kernels back to back
    finally:
        busy.kill()
        busy.communicate()


WAITER = "#include <stdio.h>\nint main(void) { char b[8]; puts(\"up\"); fflush(stdout);\n  return fgets(b, sizeof b, stdin) == NULL; }\n"  # fmt: skip


def _waiter(cc: list[str], out: Path) -> Path:
    src = out.with_suffix(".c")
    src.write_text(WAITER)
    subprocess.run([*cc, "-o", str(out), str(src)], check=True)
    return out


@pytest.mark.parametrize(
    ("kind", "cc", "preload", "expected"),
    [
        ("glibc", ["gcc"], True, None),
        ("glibc", ["gcc"], False, "the shim is not loaded into it"),
        ("static", ["gcc", "-static"], True, "static binary"),
        ("musl", ["musl-gcc"], False, "musl"),
    ],
)
def test_the_memory_map_says_whether_and_why_the_shim_is_missing(
    tmp_path: Path, kind: str, cc: list[str], preload: bool, expected: str | None
) -> None:
    """Real programs: with the shim preloaded, without it, a static binary (the loader that
    would preload it is absent) and a musl program (its loader never reads /etc/ld.so.preload;
    with LD_PRELOAD it does not even start: the shim needs glibc's symbols)."""
    if shutil.which(cc[0]) is None:
        pytest.skip(f"{cc[0]} is missing (Debian package musl-tools; scripts/setup installs it)")
    prog = _waiter(cc, tmp_path / f"waiter-{kind}")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = str(shim_library())
    p = subprocess.Popen([str(prog)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline() == "up\n"
        why = missing_shim(p.pid)
    finally:
        p.communicate("x\n", timeout=10)
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why, why


@pytest.mark.slow
def test_a_slice_process_without_the_shim_is_reported_and_stopped_under_quota(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path]
) -> None:
    """Far under its quota, a process that never loaded the shim is still unlimited: reported
    once (log line, gauge) and, with --enforce kill, stopped; its shimmed neighbour is not."""
    ops = build_c("shim_ops.c")
    acct = tmp_path / "slice.region"
    region_with_limits(acct, 1 << 30)
    exp = ExporterProcess(
        ["--sim", "--data-dir", str(tmp_path / "none"), "--region", str(acct),
         "--enforce", "kill"],
        sim_env,
    )  # fmt: skip
    slice_env = dict(sim_env, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(acct))
    try:
        shimmed = Held(ops, dict(slice_env, LD_PRELOAD=str(shim_library())),
                       "init", "ctx", f"alloc:{32 * MiB}")  # fmt: skip
        try:
            bare = Held(ops, slice_env, "init", "ctx", f"alloc:{32 * MiB}")
            assert bare.proc.wait(20) == -signal.SIGTERM
            got = only(scrape(exp.url), "vgpu_slice_processes_without_shim", claim=str(acct))
            assert [g.value for g in got] in ([1.0], [0.0])  # 0 once a pass saw it gone
            assert _wait(lambda: only(scrape(exp.url), "vgpu_slice_processes_without_shim",
                                      claim=str(acct))[0].value == 0)  # fmt: skip
            assert shimmed.proc.poll() is None
            assert _violations(exp.url, str(acct)) == 0  # under quota: no violation
        finally:
            shimmed.release()
    finally:
        log = exp.stop()
    lines = [line for line in log.splitlines() if "process without the shim" in line]
    assert len(lines) == 1, log
    assert f"pid {bare.proc.pid}" in lines[0] and "the shim is not loaded into it" in lines[0]
    assert f"stopping pids [{bare.proc.pid}]" in log


# ---------------------------------------------------------------- attribution and stopping


def _static_waiter(tmp_path: Path) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is missing")
    return _waiter(["gcc", "-static"], tmp_path / "waiter-static")


@pytest.fixture
def two_regions(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a" / "accounting", tmp_path / "b" / "accounting"
    for r in (a, b):
        r.parent.mkdir()
        region_with_limits(r, 1 << 30)
    return a, b


def _ident(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_dev, st.st_ino


def test_a_process_is_attributed_by_the_file_it_has_not_the_one_it_names(
    tmp_path: Path, two_regions: tuple[Path, Path]
) -> None:
    """Its environment names B, but it has A open, or mapped: it is A's."""
    a, b = two_regions
    known = {_ident(a): "a", _ident(b): "b"}
    env = dict(os.environ, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(b))
    opener = ("import mmap, os, sys; f = open(sys.argv[1], 'rb'); "
              "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if sys.argv[2] == 'map' else None; "
              "g = None if m is None else f.close(); print('up', flush=True); sys.stdin.read()")  # fmt: skip
    for how in ("open", "map"):
        p = subprocess.Popen([sys.executable, "-c", opener, str(a), how], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert p.stdout is not None and p.stdout.readline() == "up\n"
            got = attribute(p.pid, known=known)
        finally:
            p.communicate("", timeout=10)
        assert got.file_id == _ident(a), (how, got)
        assert got.how == ("open" if how == "open" else "mapped")
        assert got.start > 0


def test_the_named_file_is_resolved_strictly_inside_the_process_root(
    tmp_path: Path, two_regions: tuple[Path, Path]
) -> None:
    """A process in a root of its own (chroot, as a container's) names /l/accounting with /l an
    absolute link to another slice's directory on the host: out of its root, so no slice's. A
    link inside its root is followed inside it."""
    chroot = shutil.which("chroot")
    if os.geteuid() != 0 or chroot is None:
        pytest.skip("needs root and chroot(8)")
    a, b = two_regions
    root = tmp_path / "root"
    root.mkdir()
    waiter = _static_waiter(tmp_path)
    shutil.copy2(waiter, root / "waiter")
    (root / "l").symlink_to(b.parent)  # the host path of B's directory
    (root / "own").mkdir()
    region_with_limits(root / "own" / "accounting", 1 << 30)
    (root / "m").symlink_to("/own")  # absolute, inside its root
    known = {_ident(a): "a", _ident(b): "b"}
    for named, expect in (("/l/accounting", None), ("/m/accounting", root / "own" / "accounting"),
                          ("/m/../../../l/accounting", None)):  # fmt: skip
        env = {"CUDA_DEVICE_MEMORY_SHARED_CACHE": named}
        p = subprocess.Popen([chroot, str(root), "/waiter"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert p.stdout is not None and p.stdout.readline() == "up\n"
            got = attribute(p.pid, known=known)
        finally:
            p.communicate("x\n", timeout=10)
        if expect is None:
            assert got.file_id is None and "unreachable inside its root" in got.why, got
        else:
            assert got.file_id == _ident(expect) and got.how == "environment", got


def test_a_pid_reused_since_the_pass_is_not_signalled(tmp_path: Path) -> None:
    p = subprocess.Popen(["sleep", "60"])
    try:
        seen = start_time(p.pid)
        assert seen > 0
        _stop([(p.pid, seen + 1)], grace=0.5)  # another process's start time: left alone
        time.sleep(0.3)
        assert p.poll() is None
        _stop([(p.pid, seen)], grace=5.0)
        assert p.wait(10) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_claims_process_must_enforce_the_claims_limits(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path]
) -> None:
    """The shim publishes where its limits come from in its slot: a process of a claim that
    runs with the environment's limits (not the plugin's file) is not enforcing the claim's."""
    ops = build_c("shim_ops.c")
    claim = tmp_path / "data" / "claims" / "uid-1"
    (claim / "shared").mkdir(parents=True)
    acct = claim / "shared" / "accounting"
    region_with_limits(acct, 1 << 30)
    (claim / "limits").write_text(f"CUDA_DEVICE_MEMORY_LIMIT_0={1 << 30}\n")
    sl = replace(region_slice(str(acct)), key="uid-1", claim_uid="uid-1", claim="c", namespace="n")
    env = dict(sim_env, LD_PRELOAD=str(shim_library()), CUDA_DEVICE_MEMORY_SHARED_CACHE=str(acct),
               CUDA_DEVICE_MEMORY_LIMIT="1Gi")  # fmt: skip
    held = Held(ops, env, "init", "ctx")
    try:
        wd = Watchdog(ViolationCounts())
        slots = {x.pid: x for x in read_slot_limits(acct)}
        a = attribute(held.proc.pid, known={_ident(acct): "uid-1"})
        assert a.how == "mapped"
        why = wd._not_enforcing(sl, held.proc.pid, a, slots, None)
        assert why is not None and "from its environment" in why, why
        assert "never registered" in (
            wd._not_enforcing(sl, held.proc.pid, replace(a, ns_pid=1), slots, None) or ""
        )
    finally:
        held.release()


@pytest.mark.parametrize(("held_mib", "violation"), [(900, False), (1200, True)])
def test_a_bursting_slice_is_held_to_its_limit_not_its_request(
    tmp_path: Path, held_mib: int, violation: bool
) -> None:
    """A bursting slice (request 512 MiB, limit 1 GiB: docs/policy.md) may hold more than its
    request by NVML's count; above its limit (plus the margin) it is a violation."""
    acct = tmp_path / "slice.region"
    region_with_limits(acct, 512 * MiB)
    counters = read_counters(str(acct), 1)
    sl = region_slice(str(acct))
    holder = start_holder(acct)
    try:
        sv = SliceDeviceView(sl, 0, counters.devices[0], 512 * MiB, 0.0, 0.0, 0, 0,
                             memory_burst_limit=1 << 30)  # fmt: skip
        counts = ViolationCounts()
        wd = Watchdog(counts)  # reports, stops nothing
        gpu = GpuReading(0, "GPU-x", "m", "p", True, 80 << 30, 2 << 30, 0.0,
                         (GpuProcess(holder.pid, held_mib * MiB, 0),))  # fmt: skip
        view = NodeView((DeviceView(gpu, (sv,), 0),), (), {sl.key: counters})
        wd.check(view, NvmlReading(taken=0.0, gpus=(gpu,)))
        assert counts.slice(sl.key, 0) == (1 if violation else 0)
    finally:
        holder.kill()
        holder.communicate()  # closes its stdout


# ------------------------------------------------- a bursting claim: its request plus its grant

GiB = 1 << 30
CLAIM_UID = "c0ffee00-0000-4000-8000-000000000037"
ENTRY, KEY = 5, 0x5EED


def bursting_claim(data: Path, request: int, limit: int) -> tuple[Path, burstpool.Pool]:
    """A bursting claim of the plugin as its data dir holds it (accounting file, limits file
    naming grant entry ENTRY and its key) and the node's pool file, writable (the plugin's)."""
    claim = data / "claims" / CLAIM_UID
    (claim / "shared").mkdir(parents=True)
    acct = claim / "shared" / "accounting"
    region.create(acct)
    (claim / "limits").write_text(render_limits_file(
        memory_limits=[request], sm_limits=[100], policy="hard", priority=1,
        shared_cache=CONTAINER_ACCOUNTING, bursts=[BurstLimit(limit, ENTRY, KEY)],
        burst_pool=CONTAINER_BURST_POOL,
    ))  # fmt: skip
    burstpool.create(data / BURST_POOL_FILE)
    return acct, burstpool.Pool(data / BURST_POOL_FILE, writable=True)


@NO_CONTEXT_MEMORY
@pytest.mark.parametrize(
    ("grant_gib", "state", "deadline_s", "key", "violation"),
    [
        (3, burstpool.GRANT_OPEN, None, KEY, False),  # request 1 + grant 3 covers 2.5
        (1, burstpool.GRANT_OPEN, None, KEY, True),  # the grant fell to 1: 2.5 > 1 + 1
        (1, burstpool.GRANT_RECLAIM, 60.0, KEY, False),  # evict: free until the deadline
        (1, burstpool.GRANT_RECLAIM, -60.0, KEY, True),  # evict: the deadline long past
        (1, burstpool.GRANT_RECLAIM, 0.0, KEY, False),  # wait: no deadline, nobody stopped
        (3, burstpool.GRANT_OPEN, None, KEY + 1, True),  # the entry is another claim's now
        (3, burstpool.GRANT_FREE, None, 0, True),  # the entry is free: no grant
    ],
    ids=["grant-covers", "grant-cut", "evict-grace", "evict-past-deadline", "wait", "not-its-entry",
         "free-entry"],
)  # fmt: skip
def test_a_bursting_claim_is_held_to_its_request_plus_its_grant(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path], host_nvml: HostNvml,
    grant_gib: int, state: int, deadline_s: float | None, key: int, violation: bool,
) -> None:  # fmt: skip
    """A claim of the plugin with request 1 GiB and limit 4 GiB whose process holds 2.5 GiB on
    the simulated GPU, by NVML's count (a real process, attributed by the accounting file its
    environment names; the host's NVML read as the watchdog reads it). The plugin's pool file
    says what it may hold: request + grant; up to its limit while a reclaim is in progress (an
    evict's grace until its deadline, a wait); its request alone when its entry is not its own."""
    ops = build_c("shim_ops.c")
    data = tmp_path / "data"
    acct, pool = bursting_claim(data, 1 * GiB, 4 * GiB)
    deadline = 0 if not deadline_s else time.time_ns() + int(deadline_s * 1e9)
    with pool:
        pool.write_grant(ENTRY, key=key, device=0, state=state, request=1 * GiB, limit=4 * GiB,
                         grant=grant_gib * GiB, deadline_unix_ns=deadline)  # fmt: skip
    holder = Held(ops, dict(sim_env, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(acct)),
                  "init", "ctx", f"alloc:{5 * GiB // 2}")  # fmt: skip
    try:
        reading = host_nvml()
        assert host_nvml.used(holder.proc.pid) == 5 * GiB // 2
        counts = ViolationCounts()
        view = ViewBuilder(SliceFinder(data), lambda: reading, counts).build()
        wd = Watchdog(counts)  # reports, stops nothing
        logs: list[str] = []
        wd.events = lambda _sl, reason, msg: logs.append(f"{reason}: {msg}")
        wd.check(view, reading)
        assert counts.slice(CLAIM_UID, 0) == (1 if violation else 0), logs
        quota = [m for m in logs if m.startswith("QuotaExceeded")]
        assert len(quota) == (1 if violation else 0), logs
        if violation and state == burstpool.GRANT_OPEN and key == KEY:
            assert f"over its request + grant ({GiB} + {GiB}) {2 * GiB}" in quota[0], quota
    finally:
        holder.kill()

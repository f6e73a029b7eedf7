"""`vgpu top`: --json (the exact schema) with tenants under the shim on the simulator, and the
live view in a real terminal (tmux) refreshing as slices and memory change."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from sharing import region
from sharing.cli import top
from sharing.counters import DeviceCounters
from sharing.observe.nodeview import DeviceView, NodeView, SliceDeviceView
from sharing.observe.nvml_reader import GpuReading
from sharing.observe.slices import Slice
from sharing.paths import shim_library
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.observers import MiB, add_claim, sim_gpu_uuid, start_tenant
from tests.support.shim_ops import Held

GiB = 1 << 30
DEVICE_KEYS = {"uuid", "name", "memory_total_bytes", "memory_used_bytes", "utilization_ratio",
               "slices"}  # fmt: skip
SLICE_KEYS = {"claim_uid", "namespace", "claim", "memory_limit_bytes", "memory_used_bytes",
              "memory_burst_limit_bytes", "memory_borrowed_bytes", "compute_limit_ratio", "compute_policy", "compute_used_ratio", "alloc_denied_total",
              "processes", "untrusted"}  # fmt: skip


def _top_json(env: dict[str, str], data: Path) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "sharing.cli", "top", "--sim", "--data-dir", str(data), "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def _wait_past_allocations(region_path: Path, tenant: subprocess.Popen[str]) -> None:
    """Until the tenant was refused once and freed its chunks (only its context is charged)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and tenant.poll() is None:
        try:
            dev = region.read(region_path).devices[0]
        except region.RegionError:
            dev = None  # not created yet
        if dev is not None and dev.denials >= 1 and dev.used == CONTEXT_MEMORY:
            return
        time.sleep(0.05)
    raise AssertionError(f"the tenant did not get past its allocations (exit {tenant.poll()})")


@pytest.mark.slow
def test_json_snapshot(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path]
) -> None:
    data = tmp_path / "data"
    gpu = sim_gpu_uuid(sim_env)
    a = add_claim(data, "uid-a", "train", gpu, GiB, 30, ns="team-a") / "accounting"
    add_claim(data, "uid-b", "infer", gpu, 2 * GiB, 50, ns="team-b")
    ops = build_c("shim_ops.c")  # before the tenant starts: its run must outlast the reading
    # The tenant launches until it is stopped, not for a fixed time: on a busy machine the
    # reading below may come late, and it must see the tenant alive.
    tenant = start_tenant(
        sim_env, a, "1Gi", 30, "--chunk-mib", "256", "--max-chunks", "8", "--seconds", "600"
    )
    inside = dict(sim_env, LD_PRELOAD=str(shim_library()), CUDA_DEVICE_MEMORY_SHARED_CACHE=str(a))
    try:
        _wait_past_allocations(a, tenant)  # then it launches until stopped
        held = Held(ops, inside, "init", "ctx", f"alloc:{100 * MiB}")
        try:
            doc = _top_json(sim_env, data)
        finally:
            held.release()
        assert tenant.poll() is None, tenant.communicate()  # it was running through the reading
    finally:
        tenant.terminate()
        tenant.communicate(timeout=60)
    assert set(doc) == {"devices", "unreadable"} and doc["unreadable"] == []
    [dev] = doc["devices"]
    assert set(dev) == DEVICE_KEYS and dev["uuid"] == gpu
    assert dev["memory_total_bytes"] > 0
    by_claim = {s["claim"]: s for s in dev["slices"]}
    assert set(by_claim) == {"train", "infer"}
    for s in by_claim.values():
        assert set(s) == SLICE_KEYS
    train = by_claim["train"]
    assert train["claim_uid"] == "uid-a" and train["namespace"] == "team-a"
    assert train["memory_limit_bytes"] == GiB and train["compute_limit_ratio"] == 0.3
    assert train["compute_policy"] == "hard"
    # the held allocation, and both processes' contexts (the tenant has freed its chunks)
    assert train["memory_used_bytes"] == 100 * MiB + 2 * CONTEXT_MEMORY
    assert train["memory_burst_limit_bytes"] == train["memory_borrowed_bytes"] == 0  # no burst
    assert train["alloc_denied_total"] == 1
    assert train["processes"] == 2  # the tenant and the held allocation
    assert 0 < train["compute_used_ratio"] < 0.6
    assert by_claim["infer"]["processes"] == 0 and by_claim["infer"]["compute_used_ratio"] == 0


def _policy_view() -> NodeView:
    """One GPU with a hard, an elastic and an uncapped (computePolicy off) slice."""

    def slice_of(name: str, policy: str, cap: float) -> SliceDeviceView:
        limits = {"VGPU_COMPUTE_POLICY": policy}
        sl = Slice(name, name, "team-a", name, "", "/x", ("GPU-0",), {}, limits=limits)
        counters = DeviceCounters(0, 132 * MiB, 900 * MiB, 1, 1, 12345, 10**9, 12 * 10**9)
        return SliceDeviceView(sl, 0, counters, GiB, cap, 0.29, 2, 0)

    gpu = GpuReading(0, "GPU-0", "NVIDIA H100 80GB HBM3", "0000", True, 80 * GiB, 3 * GiB, 0.5)
    slices = (slice_of("train", "hard", 0.3), slice_of("infer", "elastic", 0.5),
              slice_of("free", "off", 0.0))  # fmt: skip
    return NodeView(devices=(DeviceView(gpu, slices, 0),), errors=(), counters={})


def test_the_cap_column_says_each_slices_compute_policy() -> None:
    """Issue 33 part 4: a slice running with computePolicy off was shown like any other. The
    cap column now says the policy its limits file holds: `30%` hard, `50%+` elastic, `off`;
    at 80 columns every figure stays whole, and --json names the policy."""
    console = Console(width=80, record=True, color_system=None)
    console.print(top.render(_policy_view(), 80))
    text = console.export_text()
    rows = {line.split()[0]: line.split() for line in text.splitlines() if "team-a/" in line}
    cap = _COLUMN_INDEX["cap"]
    assert {name: cells[cap] for name, cells in rows.items()} == {
        "team-a/train": "30%", "team-a/infer": "50%+", "team-a/free": "off",
    }  # fmt: skip
    assert all(cells[-1] == "2" for cells in rows.values()), text  # procs: whole
    assert "off: compute policy off, no cap" in text
    doc = top.to_json(_policy_view())
    assert [s["compute_policy"] for s in doc["devices"][0]["slices"]] == ["hard", "elastic", "off"]


_COLUMN_INDEX = {name: i + 1 for i, name in enumerate(top._COLUMNS)}


def test_a_bursting_slice_adds_the_borrowed_column() -> None:
    """docs/policy.md, bursting: where a slice bursts, a borrowed column after used says what it
    uses above its request (blank for the others; the device's row sums them); without one the
    table keeps its columns (above)."""

    def slice_of(name: str, used: int, burst_limit: int) -> SliceDeviceView:
        sl = Slice(name, name, "team-a", name, "", "/x", ("GPU-0",), {},
                   limits={"VGPU_COMPUTE_POLICY": "hard"})  # fmt: skip
        counters = DeviceCounters(0, used, used, 0, 1, 0, 0, 0)
        return SliceDeviceView(sl, 0, counters, GiB, 0.3, 0.1, 1, 0,
                               memory_burst_limit=burst_limit)  # fmt: skip

    gpu = GpuReading(0, "GPU-0", "NVIDIA H100 80GB HBM3", "0000", True, 80 * GiB, 3 * GiB, 0.5)
    slices = (slice_of("burst", 3 * GiB, 4 * GiB), slice_of("plain", 512 * MiB, 0))
    view = NodeView(devices=(DeviceView(gpu, slices, 0),), errors=(), counters={})
    console = Console(width=100, record=True, color_system=None)
    console.print(top.render(view, 100))
    text = console.export_text()
    header = next(line.split() for line in text.splitlines() if "quota" in line)
    assert header[header.index("used") + 1] == "borrowed", text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if "team-a/" in line}
    col = header.index("borrowed") - 2  # "GPU / slice": three words of the header, one cell
    assert rows["team-a/burst"][col] == "2.0G", text  # 3 GiB used of a 1 GiB request
    # the plain slice's borrowed cell is blank: its next figure there is its peak
    assert rows["team-a/plain"][col] == "512M" and len(rows["team-a/plain"]) == len(
        rows["team-a/burst"]) - 1, text  # fmt: skip


def _tmux() -> str:
    tool = shutil.which("tmux")
    if tool is None:
        pytest.skip("tmux is missing (Debian package tmux; scripts/setup installs it)")
    return tool


@pytest.mark.slow
def test_live_view_in_a_terminal(
    sim_env: dict[str, str], tmp_path: Path, build_c: Callable[..., Path]
) -> None:
    tmux = _tmux()
    data = tmp_path / "data"
    gpu = sim_gpu_uuid(sim_env)
    a = add_claim(data, "uid-a", "train", gpu, GiB, 30, ns="team-a") / "accounting"
    sock = f"vgpu-top-{uuid.uuid4().hex[:8]}"
    cmd = f"{sys.executable} -m sharing.cli top --sim --data-dir {data}"
    env = dict(sim_env, TERM="xterm-256color")
    subprocess.run([tmux, "-L", sock, "new-session", "-d", "-s", "top", "-x", "80", "-y", "30",
                    cmd], env=env, check=True)  # fmt: skip

    def screen() -> str:
        r = subprocess.run([tmux, "-L", sock, "capture-pane", "-p", "-t", "top"],
                           capture_output=True, text=True, check=True)  # fmt: skip
        return r.stdout

    def shows(text: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = screen()
            if text in s:
                return s
            time.sleep(0.3)
        raise AssertionError(f"{text!r} never appeared; screen:\n{screen()}")

    try:
        first = shows("team-a/train")
        assert "quota" in first and "got" in first and "H100" in first
        # a new claim and an allocation appear without a restart
        add_claim(data, "uid-b", "infer", gpu, 2 * GiB, 50, ns="team-b")
        shows("team-b/infer")
        inside = dict(sim_env, LD_PRELOAD=str(shim_library()),
                      CUDA_DEVICE_MEMORY_SHARED_CACHE=str(a))  # fmt: skip
        held = Held(build_c("shim_ops.c"), inside, "init", "ctx", f"alloc:{100 * MiB}")
        try:
            held_m = f"{(100 * MiB + CONTEXT_MEMORY) // MiB}M"  # its allocation and its context
            s = shows(f" {held_m} ")
            [row] = [line for line in s.splitlines() if "team-a/train" in line]
            assert held_m in row and "1.0G" in row and "30%" in row
            # 80 columns: every figure is whole (the names give way), procs included
            cells = row.split()
            assert "…" not in row and cells[-1] == "1" and cells[-5].endswith("%"), s
        finally:
            held.release()
        subprocess.run([tmux, "-L", sock, "send-keys", "-t", "top", "q"], check=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = subprocess.run([tmux, "-L", sock, "has-session", "-t", "top"],
                               capture_output=True)  # fmt: skip
            if r.returncode != 0:
                break  # vgpu top exited on q and took the session with it
            time.sleep(0.2)
        else:
            raise AssertionError(f"vgpu top did not exit on q:\n{screen()}")
    finally:
        subprocess.run([tmux, "-L", sock, "kill-server"], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_a_region_that_is_not_there_is_an_error(
    sim_env: dict[str, str], tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "a.region"
    if kind == "directory":
        path.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "sharing.cli", "top", "--sim", "--once", "--region", str(path)],
        env=sim_env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    what = "No such file or directory" if kind == "missing" else "not a regular file"
    assert r.stderr.startswith(f"vgpu top: --region {path}: {what}"), r.stderr
    assert r.stderr.count("\n") == 1

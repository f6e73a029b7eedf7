"""A tenant attacks the observers through its own accounting file, which every process of its
slice can write: truncating it (to 0 or to part of its size), growing it, and writing counters
no slice can hold. The readers outside the slice (the plugin's --metrics-address with its
watchdog, `vgpu exporter`, `vgpu top`) must survive each, mark that one slice unreadable (one log
line, `vgpu_slice_unreadable`) or untrusted (figures clamped to the device's memory,
`vgpu_slice_untrusted`), and go on serving the other slices.

Each reader is a real process; the attack happens after it has read the file once (a reader
that maps the file then dies of SIGBUS at its next look)."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sharing._region_cffi import ffi, lib

from sharing import region
from tests.driver.kubelet_standin import KubeletStandin, allocated_claim, claim_id, result
from tests.fakes.apiserver import FakeApiServer, free_port
from tests.support.observers import ExporterProcess, Sample, add_claim, only, scrape, sim_gpu_uuid
from tests.support.plugin_e2e import (
    DRIVER,
    PluginProcess,
    claim_world,
    device,
    root,
    server,
    sim_ready,
    wait_names,
    write_config,
)

pytestmark = pytest.mark.slow

__all__ = ["root", "server", "sim_ready"]  # fixtures used by name
GiB = 1 << 30
U64_MAX = (1 << 64) - 1

# The attacks, as a tenant performs them on the file (from inside: `: > accounting`,
# os.truncate, a write past its end).
ATTACKS: dict[str, Callable[[Path], None]] = {
    "truncate-to-0": lambda p: os.truncate(p, 0),
    "truncate-to-part": lambda p: os.truncate(p, region.FILE_SIZE // 3),
    "grow": lambda p: os.truncate(p, region.FILE_SIZE + 4096),
}


def _unreadable(s: list[Sample], uid: str) -> bool:
    return [x.value for x in only(s, "vgpu_slice_unreadable", claim_uid=uid)] == [1.0]


def _scrape_until(
    url: str, ok: Callable[[list[Sample]], bool], alive: Callable[[], str | None]
) -> list[Sample]:
    """Scrape until ok(); fails at once with the reader's output if it died."""
    deadline = time.monotonic() + 20
    while True:
        died = alive()
        assert died is None, died
        s = scrape(url)
        if ok(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def _holds_open(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open (it has read the file once and keeps it)."""
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            if os.readlink(fd) == str(path):
                return True
        except OSError:
            continue
    return False


def poison(path: Path) -> int:
    """Write counters no slice can hold into devices[0] and one live slot (held by an fd this
    returns: the slot's byte lock, as a live process of the slice holds it)."""
    fd = os.open(path, os.O_RDWR)
    lock = struct.pack("hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, lib.VGPU_SLOT_LOCK_BASE, 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
    u64 = struct.Struct("@Q")
    dev = ffi.offsetof("struct vgpu_region", "devices")
    slot = ffi.offsetof("struct vgpu_region", "procs")
    for field in ("used", "peak"):
        os.pwrite(fd, u64.pack(U64_MAX), dev + ffi.offsetof("struct vgpu_device_account", field))
    os.pwrite(fd, struct.pack("@iI", os.getpid(), lib.VGPU_SLOT_LIVE), slot)
    os.pwrite(fd, u64.pack(U64_MAX), slot + ffi.offsetof("struct vgpu_proc_slot", "used"))
    os.pwrite(fd, struct.pack("@I", 1), ffi.offsetof("struct vgpu_region", "slots_hwm"))
    return fd


@pytest.fixture
def two_claims(sim_env: dict[str, str], tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A data dir with claims uid-a (the attacker) and uid-b on the simulated GPU."""
    data = tmp_path / "data"
    gpu = sim_gpu_uuid(sim_env)
    add_claim(data, "uid-a", "attacker", gpu, GiB, 30, ns="team-a")
    add_claim(data, "uid-b", "victim", gpu, 2 * GiB, 50, ns="team-b")
    yield data, gpu


def _accounting(data: Path, uid: str) -> Path:
    return data / "claims" / uid / "shared" / "accounting"


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_exporter_survives_a_tenant_truncating_or_growing_its_file(
    sim_env: dict[str, str], two_claims: tuple[Path, str], attack: str
) -> None:
    data, _ = two_claims
    target = _accounting(data, "uid-a")
    exp = ExporterProcess(["--sim", "--data-dir", str(data), "--cache", "0"], sim_env)

    def alive() -> str | None:
        return None if exp.proc.poll() is None else f"exporter died: {exp.proc.returncode}"

    try:
        s = scrape(exp.url)  # the exporter has read (on main: mapped) both files
        assert {x.labels["claim_uid"] for x in only(s, "vgpu_slice_memory_used_bytes")} == {
            "uid-a",
            "uid-b",
        }
        assert _holds_open(exp.proc.pid, target)
        ATTACKS[attack](target)
        s = _scrape_until(exp.url, lambda s: _unreadable(s, "uid-a"), alive)
        assert _unreadable(s, "uid-a")
        assert only(s, "vgpu_slices_unreadable")[0].value == 1
        # the attacker's slice is out of the figures; the victim's are served as before
        assert only(s, "vgpu_slice_memory_used_bytes", claim_uid="uid-a") == []
        assert len(only(s, "vgpu_slice_memory_limit_bytes", claim_uid="uid-b")) == 1
        assert only(s, "vgpu_slice_unreadable", claim_uid="uid-b") == []
        time.sleep(2.5)  # watchdog passes (one per NVML reading, every second) read it too
        os.truncate(target, 100)  # another bad size: still the same trouble, no new line
        time.sleep(1.5)
        s = _scrape_until(exp.url, lambda s: _unreadable(s, "uid-a"), alive)
        log = exp.stop()
    finally:
        if exp.proc.poll() is None:
            exp.proc.kill()
            exp.proc.wait()
    # one line for the slice, however many builders and passes saw it
    lines = [ln for ln in log.splitlines() if str(target) in ln]
    assert len(lines) == 1, log
    assert "expected" in lines[0] or "cut short" in lines[0]


def test_exporter_clamps_and_flags_impossible_counters(
    sim_env: dict[str, str], two_claims: tuple[Path, str]
) -> None:
    data, _ = two_claims
    fd = poison(_accounting(data, "uid-a"))
    exp = ExporterProcess(["--sim", "--data-dir", str(data), "--cache", "0"], sim_env)
    try:
        s = scrape(exp.url)
        for _ in range(50):  # the first NVML reading (device memory) may still be on its way
            if only(s, "vgpu_device_memory_total_bytes"):
                break
            time.sleep(0.1)
            s = scrape(exp.url)
        [total] = only(s, "vgpu_device_memory_total_bytes")
        [used_a] = only(s, "vgpu_slice_memory_used_bytes", claim_uid="uid-a")
        [peak_a] = only(s, "vgpu_slice_memory_peak_bytes", claim_uid="uid-a")
        assert used_a.value == total.value and peak_a.value == total.value
        assert [x.value for x in only(s, "vgpu_slice_untrusted", claim_uid="uid-a")] == [1.0]
        assert [x.value for x in only(s, "vgpu_slice_untrusted", claim_uid="uid-b")] == [0.0]
        node_sum = sum(x.value for x in only(s, "vgpu_slice_memory_used_bytes"))
        assert node_sum <= total.value
        exp.stop()
    finally:
        os.close(fd)
        if exp.proc.poll() is None:
            exp.proc.kill()
            exp.proc.wait()


def _top_json(env: dict[str, str], data: Path) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "sharing.cli", "top", "--sim", "--data-dir", str(data), "--json",
         "--interval", "0.2"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_top_once_survives_a_file_cut_between_its_two_looks(
    sim_env: dict[str, str], two_claims: tuple[Path, str], attack: str
) -> None:
    data, _ = two_claims
    target = _accounting(data, "uid-a")
    top = subprocess.Popen(
        [sys.executable, "-m", "sharing.cli", "top", "--sim", "--data-dir", str(data), "--once",
         "--interval", "3"],
        env=dict(sim_env, COLUMNS="200"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _holds_open(top.pid, target):  # its first look has read the file
            assert top.poll() is None and time.monotonic() < deadline, top.communicate()
            time.sleep(0.02)
        ATTACKS[attack](target)
        out, err = top.communicate(timeout=60)
    finally:
        if top.poll() is None:
            top.kill()
            top.wait()
    assert top.returncode == 0, err
    assert "attacker" in out and "(unreadable)" in out, out
    assert "team-b/victim" in out, out


def test_top_shows_impossible_counters_clamped_and_untrusted(
    sim_env: dict[str, str], two_claims: tuple[Path, str]
) -> None:
    data, _ = two_claims
    fd = poison(_accounting(data, "uid-a"))
    try:
        doc = _top_json(sim_env, data)
    finally:
        os.close(fd)
    [dev] = doc["devices"]
    by_claim = {s["claim"]: s for s in dev["slices"]}
    assert by_claim["attacker"]["memory_used_bytes"] == dev["memory_total_bytes"] > 0
    assert by_claim["attacker"]["untrusted"] is True
    assert by_claim["victim"]["untrusted"] is False
    assert doc["unreadable"] == []


@pytest.mark.parametrize("attack", ["truncate-to-0", "truncate-to-part"])
def test_plugin_survives_a_tenant_truncating_its_accounting_file(
    sim_ready: None, server: FakeApiServer, root: Path, attack: str
) -> None:
    """The root plugin with --metrics-address: its watchdog reads every slice's file at each
    NVML pass, scraped or not. After the attack it still prepares and unprepares claims."""
    write_config(root / "simgpu.json", [device(0)])
    mport = free_port()
    url = f"http://127.0.0.1:{mport}"
    p = PluginProcess(server, root, "--metrics-address", f"127.0.0.1:{mport}")

    def alive() -> str | None:
        return None if p.proc.poll() is None else f"plugin died: {p.output()}"

    try:
        wait_names(server, p, ["gpu-0"])
        kubelet = KubeletStandin(root / "reg" / f"{DRIVER}-reg.sock")
        kubelet.register()
        share = {"consumedCapacity": {"memory": "1Gi", "cores": "30"}}
        claims = [
            server.put(
                allocated_claim(n, namespace="team", results=[result("gpu", "gpu-0") | share])
            )
            for n in ("attacker", "victim", "later")
        ]
        uids = [c["metadata"]["uid"] for c in claims]
        assert all(
            r.error == "" for r in kubelet.prepare([claim_id(c) for c in claims[:2]]).values()
        )
        target = root / "data" / "claims" / uids[0] / "shared" / "accounting"
        _scrape_until(url, lambda s: len(only(s, "vgpu_slice_memory_used_bytes")) == 2, alive)
        deadline = time.monotonic() + 20
        while not _holds_open(p.proc.pid, target):  # read by the watchdog or a scrape
            assert alive() is None and time.monotonic() < deadline
            time.sleep(0.05)
        ATTACKS[attack](target)
        time.sleep(2.5)  # two watchdog passes, no scrape
        assert alive() is None
        s = _scrape_until(url, lambda s: _unreadable(s, uids[0]), alive)
        assert _unreadable(s, uids[0])
        assert len(only(s, "vgpu_slice_memory_limit_bytes", claim_uid=uids[1])) == 1
        # prepare and unprepare go on for every tenant
        assert kubelet.prepare([claim_id(claims[2])])[uids[2]].error == ""
        assert all(e == "" for e in kubelet.unprepare([claim_id(c) for c in claims]).values())
        kubelet.close()
    finally:
        code = p.terminate()
    assert code == 0, p.output()
    assert p.output().count(f"{target}: ") == 1, p.output()


def test_the_plugin_cuts_back_an_accounting_file_grown_from_inside(
    sim_ready: None, server: FakeApiServer, root: Path
) -> None:
    """A process of the claim writes past the end of its accounting file (512 MiB in the attack
    review; the data dir is on the node's root file system). The plugin's watchdog (enforce
    kill, as deploy/base runs it) cuts the file back to its size, says so once, and the slice is
    readable again."""
    with claim_world(server, root, first="grower") as w:
        uid = w.uids[0]
        target = root / "data" / "claims" / uid / "shared" / "accounting"

        def alive() -> str | None:
            return None if w.plugin.proc.poll() is None else f"plugin died: {w.plugin.output()}"

        def served(s: list[Sample]) -> bool:
            return len(only(s, "vgpu_slice_memory_used_bytes", claim_uid=uid)) == 1

        _scrape_until(w.url, served, alive)
        with target.open("r+b") as f:  # as a tenant does from inside: write past the end
            f.seek(region.FILE_SIZE + (64 << 20))
            f.write(b"x" * 4096)
        deadline = time.monotonic() + 20
        while target.stat().st_size != region.FILE_SIZE:
            assert alive() is None and time.monotonic() < deadline, target.stat().st_size
            time.sleep(0.2)
        s = _scrape_until(w.url, served, alive)
        assert only(s, "vgpu_slice_unreadable", claim_uid=uid) == []
    lines = [x for x in w.plugin.output().splitlines() if "accounting file grew to" in x]
    assert len(lines) == 1, w.plugin.output()
    assert f"cut back to {region.FILE_SIZE} bytes" in lines[0] and "team/grower" in lines[0]

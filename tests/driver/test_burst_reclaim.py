"""Taking borrowed memory back in prepare (docs/policy.md, "Taking it back"), with real borrowers:
programs (tests/c/burst_borrower.c) started with their claim's CDI mounts on the simulated GPU,
the plugin over its real gRPC sockets, real signals. Each test prepares a new claim whose request
needs memory a bursting claim borrows, and checks what the borrower's processes and the slice's
usage are when the prepare has answered: every borrower within its new grant, so the new claim's
request is free.

- evict: the notice (SIGWINCH and the pool entry's RECLAIM state) lets a polite borrower free and
  live; a deaf one is stopped after the grace, newest process first until it fits; a borrower in
  the middle of a cudaMalloc storm; two borrowers; a request that fills the device;
- wait: the prepare fails with the documented line while the memory is borrowed, and succeeds once
  it is given back;
- a borrower that lowers its own accounting file's charges (a root tenant can write it) is still
  measured by the host NVML's count of its processes: evicted, or failing a `wait`;
- a plugin killed during an evict (SIGKILL after the notice) finishes it at its next start;
- greedy borrowers while claims are prepared and unprepared concurrently, the host's NVML sampled
  from outside: never a byte of a prepared claim's request held by a borrower.

Waiting is on conditions with deadlines; nothing here asserts a duration.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sharing._region_cffi import ffi, lib

from driver.opmetrics import OperationMetrics
from sharing import burstpool, region
from sharing.observe.procinfo import start_time
from sharing.policy import BUILTIN, Burst
from tests.driver.kubelet_standin import ClaimId, KubeletStandin, result
from tests.driver.plugin_process import PluginProcess, fake_gpus
from tests.fakes.apiserver import FakeApiServer
from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support import cdi_exec
from tests.support.burst_world import (
    claim,
    data_dir,
    grant_of,
    granted,
    prepare,
    spec_path,
)
from tests.support.host_nvml import HostNvml
from tests.support.prepare_world import World, close_world, make_world

pytestmark = [NO_CONTEXT_MEMORY, pytest.mark.slow]

GiB = 1024**3
DEADLINE = 60.0


def policy(**burst: Any) -> Any:
    b = Burst(max_ratio=8, from_claim=True, **burst)
    rules = replace(BUILTIN, burst=b)
    return lambda _g: rules


@pytest.fixture
def borrower_bin(build_c: Callable[..., Path]) -> Path:
    cdi_exec.skip_unless_possible()
    return build_c("burst_borrower.c")


@pytest.fixture
def worlds() -> Iterator[Callable[..., World]]:
    made: list[World] = []

    def make(gpus: Any = None, nvml: Any = None, **burst: Any) -> World:
        w: World = make_world(rules_for=policy(**burst), gpus=gpus, nvml=nvml)
        made.append(w)
        return w

    yield make
    for w in made:
        close_world(w)


def nvml_world(worlds: Callable[..., World], nvml: HostNvml, **burst: Any) -> World:
    """A world whose plugin reads the host NVML: its GPU 0 is the simulated GPU (NVML's UUID, the
    stand-in's memory)."""
    uuid = nvml().gpus[0].uuid
    gpus = [replace(g, uuid=uuid) if g.index == 0 else g for g in fake_gpus()]
    return worlds(gpus=gpus, nvml=nvml, **burst)


class Borrower:
    """A burst_borrower process in a claim's "container"."""

    def __init__(self, binary: Path, spec: Path, sim_env: dict[str, str], mode: str,
                 chunk: int, n: int, keep: int) -> None:  # fmt: skip
        self.proc = cdi_exec.popen(
            spec, sim_env, [str(binary), mode, str(chunk), str(n), str(keep)]
        )
        self.held = int(self._expect("held"))

    def _expect(self, word: str) -> str:
        """The program's next line, which must start with word (within DEADLINE)."""
        stdout = self.proc.stdout
        assert stdout is not None
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(DEADLINE)
        line = got[0] if got else f"(no line within {DEADLINE}s)"
        assert line.startswith(word), (line, self.stop())
        return line.split()[1]

    def freed(self) -> int:
        return int(self._expect("freed"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        _out, err = self.proc.communicate(timeout=30)
        return err


@pytest.fixture
def borrowers() -> Iterator[list[Borrower]]:
    made: list[Borrower] = []
    yield made
    for b in made:
        b.stop()


def used(w: World, c: ClaimId) -> int:
    """The slice's live processes' charges on its device 0 (its accounting file)."""
    return region.read(data_dir(w) / "claims" / c.uid / "shared" / "accounting").used_by_live(0)


def lower_used(w: World, c: ClaimId) -> None:
    """What a root tenant can do to its own accounting file: zero every charge in it (each slot's
    and each device's `used`), as if its processes held nothing."""
    zeros = bytes(8 * lib.VGPU_MAX_DEVICES)
    slot = ffi.sizeof("struct vgpu_proc_slot")
    procs = ffi.offsetof("struct vgpu_region", "procs")
    used_at = ffi.offsetof("struct vgpu_proc_slot", "used")
    account = ffi.sizeof("struct vgpu_device_account")
    devices = ffi.offsetof("struct vgpu_region", "devices")
    device_used = ffi.offsetof("struct vgpu_device_account", "used")
    with (data_dir(w) / "claims" / c.uid / "shared" / "accounting").open("r+b") as f:
        for i in range(lib.VGPU_MAX_PROCS):
            f.seek(procs + i * slot + used_at)
            f.write(zeros)
        for d in range(lib.VGPU_MAX_DEVICES):
            f.seek(devices + d * account + device_used)
            f.write(bytes(8))
    assert used(w, c) == 0


def events(server: FakeApiServer, c: ClaimId, reason: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + DEADLINE  # posted in a thread of their own
    while True:
        found = [e for e in server.objects("Event")
                 if e["involvedObject"].get("uid") == c.uid and e["reason"] == reason]  # fmt: skip
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def ticks_now() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < deadline, f"not within {DEADLINE}s: {what}"
        time.sleep(0.02)


def start(borrower_bin: Path, w: World, c: ClaimId, sim_env: dict[str, str], mode: str,
          chunks: int, keep: int, out: list[Borrower], chunk: int = 5 * GiB) -> Borrower:  # fmt: skip
    b = Borrower(borrower_bin, spec_path(w, c), sim_env, mode, chunk, chunks, keep)
    out.append(b)
    return b


def test_evict_a_polite_borrower_frees_on_the_notice_and_lives(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower],
) -> None:  # fmt: skip
    w = worlds(reclaim="evict", grace=20.0)
    a = claim(w, "a", "20Gi", "3x")
    prepare(w, a)
    b = start(borrower_bin, w, a, sim_env, "polite", 10, 4, borrowers)
    assert b.held == 10 and used(w, a) == 50 * GiB  # 30 GiB borrowed of a grant of 40
    assert metrics(w)[("vgpu_slice_borrowed_bytes", ("default/a", "gpu-0"))] == 30 * GiB
    new = claim(w, "b", "40Gi")
    prepare(w, new)  # pool 20 GiB: a's grant falls to 20, it must give 10 back
    assert b.freed() == 4 and b.alive()
    assert used(w, a) <= 20 * GiB + granted(w, a) and granted(w, a) == 20 * GiB
    assert events(w.server, a, "BurstReclaimNotice") and events(w.server, a, "BurstReclaimed")
    assert "no process stopped" in events(w.server, a, "BurstReclaimed")[0]["message"]
    assert w.plugin.driver.state.reclaims.outcomes == {"freed": 1, "evicted": 0, "timeout": 0}
    assert metrics(w)[("vgpu_slice_borrowed_bytes", ("default/a", "gpu-0"))] == 0


def test_evict_a_borrower_that_ignores_the_notice_is_stopped_after_the_grace(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower],
) -> None:  # fmt: skip
    w = worlds(reclaim="evict", grace=0.5)
    a = claim(w, "a", "20Gi", "3x")
    prepare(w, a)
    deaf = start(borrower_bin, w, a, sim_env, "deaf", 10, 0, borrowers)
    assert used(w, a) == 50 * GiB
    prepare(w, claim(w, "b", "40Gi"))
    assert deaf.proc.wait(DEADLINE) == -9  # SIGKILL
    assert used(w, a) == 0
    (ev,) = events(w.server, a, "BurstReclaimed")
    assert f"processes stopped: {deaf.proc.pid}" in ev["message"], ev["message"]
    assert w.plugin.driver.state.reclaims.outcomes["evicted"] == 1
    m = metrics(w)
    assert m[("vgpu_burst_reclaims_total", ("evicted",))] == 1
    assert m[("vgpu_burst_reclaims_total", ("freed",))] == 0
    assert m[("vgpu_burst_reclaim_seconds_count", ())] == 1
    assert m[("vgpu_slice_borrowed_bytes", ("default/a", "gpu-0"))] == 0
    assert m[("vgpu_burst_grant_bytes", ("default/a", "gpu-0"))] == 20 * GiB
    assert m[("vgpu_burst_pool_bytes", ("gpu-0",))] == 20 * GiB


def metrics(w: World) -> dict[tuple[str, tuple[str, ...]], float]:
    """The plugin's burst series as the metrics endpoint renders them (labels but driver)."""
    ops = OperationMetrics("vgpu.sharing.dev")
    ops.track_burst(w.plugin.driver.state.burst_reading)
    out = {}
    for fam in text_string_to_metric_families(ops.render().decode()):
        for smp in fam.samples:
            labels = tuple(v for k, v in smp.labels.items() if k not in ("driver", "le"))
            if "le" not in smp.labels:
                out[(smp.name, labels)] = smp.value
    return out


def test_evict_during_a_cudamalloc_storm(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower],
) -> None:  # fmt: skip
    """Four threads allocate and free 1 GiB blocks on top of 50 GiB held when the grant falls:
    an allocation in flight is either refused by the new grant or seen by the plugin, so when
    the prepare answers the slice is within request + grant, whether it freed in time or not."""
    w = worlds(reclaim="evict", grace=5.0)
    a = claim(w, "a", "20Gi", "3x")
    prepare(w, a)
    storm = start(borrower_bin, w, a, sim_env, "storm", 50, 20, borrowers, chunk=1 * GiB)
    assert storm.held == 50
    prepare(w, claim(w, "b", "40Gi"))
    assert used(w, a) <= 20 * GiB + granted(w, a)
    assert storm.alive() and storm.freed() == 20


def test_two_borrowers_newest_claim_and_newest_process_first(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower],
) -> None:  # fmt: skip
    """a (10 GiB, limit 40) runs two deaf processes holding 20 and 15 GiB; b (10 GiB, limit 40)
    one holding 35. A claim of 45 GiB leaves a pool of 15: a's grant 15 (older), b's 0. The
    plugin stops b's process, and of a's only the newer: a then borrows 10 <= 15."""
    w = worlds(reclaim="evict", grace=0.2)
    a = claim(w, "a", "10Gi", "4x")
    b = claim(w, "b", "10Gi", "4x")
    prepare(w, a)
    prepare(w, b)
    a1 = start(borrower_bin, w, a, sim_env, "deaf", 4, 0, borrowers)
    wait_for(lambda: used(w, a) == 20 * GiB, "a1 holds 20 GiB")
    # start times are in clock ticks: a2 must start at least one tick after a1
    wait_for(lambda: ticks_now() > start_time(a1.proc.pid), "a clock tick after a1's start")
    a2 = start(borrower_bin, w, a, sim_env, "deaf", 3, 0, borrowers)
    b1 = start(borrower_bin, w, b, sim_env, "deaf", 7, 0, borrowers)
    assert (a1.held, a2.held, b1.held) == (4, 3, 7)
    prepare(w, claim(w, "c", "45Gi"))
    assert (granted(w, a), granted(w, b)) == (15 * GiB, 0)
    assert b1.proc.wait(DEADLINE) == -9 and a2.proc.wait(DEADLINE) == -9
    assert a1.alive()
    assert used(w, a) == 20 * GiB and used(w, b) == 0


def test_a_request_that_exactly_fills_the_device(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower],
) -> None:  # fmt: skip
    w = worlds(reclaim="evict", grace=0.2)
    a = claim(w, "a", "20Gi", "4x")  # may borrow the whole rest: 60 GiB
    prepare(w, a)
    deaf = start(borrower_bin, w, a, sim_env, "deaf", 12, 0, borrowers)
    assert used(w, a) == 60 * GiB
    prepare(w, claim(w, "b", "60Gi"))  # 20 + 60 = the device: the pool is 0
    assert granted(w, a) == 0
    assert deaf.proc.wait(DEADLINE) == -9 and used(w, a) == 0
    with burstpool.Pool(data_dir(w) / "burst-pool") as p:
        assert p.read_device(0) == (80 * GiB, 0, 80 * GiB, 0, 0)


def test_wait_fails_the_prepare_while_borrowed_and_succeeds_once_given_back(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower],
) -> None:  # fmt: skip
    w = worlds(reclaim="wait", timeout=1.0)
    a = claim(w, "a", "20Gi", "3x")
    prepare(w, a)
    holder = start(borrower_bin, w, a, sim_env, "deaf", 10, 0, borrowers)
    new = claim(w, "train", "40Gi")
    err = w.kubelet.prepare([new])[new.uid].error
    assert err == (
        "device gpu-0: 10.0 GiB of the 40.0 GiB this claim's request needs are borrowed by "
        "claim default/a and were not given back within 1s (burst reclaim: wait); the kubelet "
        "retries"
    ), err
    assert holder.alive()  # wait stops nobody
    assert not spec_path(w, new).exists()
    assert granted(w, a) == 40 * GiB  # the failed claim's request is back in the pool
    holder.stop()
    wait_for(lambda: used(w, a) == 0, "the holder's memory is freed")
    prepare(w, new)
    assert granted(w, a) == 20 * GiB
    # nothing was borrowed at the retry: no reclaim
    assert w.plugin.driver.state.reclaims.outcomes == {"freed": 0, "evicted": 0, "timeout": 1}


def prepare_in_background(w: World, c: ClaimId) -> tuple[threading.Thread, list[str]]:
    """The kubelet's prepare of c in a thread of its own; its answer (the error) lands in the
    list."""
    answer: list[str] = []
    waiting = threading.Thread(target=lambda: answer.append(w.kubelet.prepare([c])[c.uid].error))
    waiting.start()
    return waiting, answer


def reclaiming(w: World, c: ClaimId) -> bool:
    """Does c's grant entry say RECLAIM?"""
    g = grant_of(w, c)
    return g is not None and g.state == burstpool.GRANT_RECLAIM


def waiting_for_a(
    w: World, borrower_bin: Path, sim_env: dict[str, str], borrowers: list[Borrower]
) -> tuple[ClaimId, Borrower, ClaimId, threading.Thread, list[str]]:
    """Claim a (20 GiB, limit 60) whose deaf process holds 50 GiB; claim train (40 GiB)
    prepared in the background, waiting for a's entry to give back 10: (a, its process, train,
    the prepare's thread, its answer)."""
    a = claim(w, "a", "20Gi", "3x")
    prepare(w, a)
    holder = start(borrower_bin, w, a, sim_env, "deaf", 10, 0, borrowers)
    new = claim(w, "train", "40Gi")
    waiting, answer = prepare_in_background(w, new)
    wait_for(lambda: reclaiming(w, a), "the borrower's entry says RECLAIM")
    return a, holder, new, waiting, answer


def test_wait_marks_the_borrowers_grant_entry_reclaim_while_it_waits(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower],
) -> None:  # fmt: skip
    """While prepare waits, the borrower's entry says RECLAIM with no deadline (what the watchdog
    holds it to its limit by: `wait` stops nobody); given back, the wait ends and it is OPEN."""
    w = worlds(reclaim="wait", timeout=40.0)
    a, holder, _new, waiting, answer = waiting_for_a(w, borrower_bin, sim_env, borrowers)
    g = grant_of(w, a)
    assert g is not None and (g.grant, g.deadline_unix_ns) == (20 * GiB, 0)
    holder.stop()
    waiting.join(DEADLINE)
    assert answer == [""]
    assert granted(w, a) == 20 * GiB  # OPEN again
    assert w.plugin.driver.state.reclaims.outcomes["freed"] == 1


def test_a_wait_holds_up_no_other_claims_prepare_or_unprepare(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower],
) -> None:  # fmt: skip
    """While a prepare waits (timeout 40 s) for claim a to give back what it borrows, a claim on
    the other GPU is prepared and answered, and the borrower's own claim is unprepared (what
    its pod's end does: the kubelet unprepares the claim once its containers are gone), which
    returns its memory to the pool: the waiting prepare then answers, well inside its timeout.
    A wait that held the plugin's lock would answer neither call before its own timed out, and
    then fail."""
    w = worlds(reclaim="wait", timeout=40.0)
    a, holder, new, waiting, answer = waiting_for_a(w, borrower_bin, sim_env, borrowers)
    other = claim(w, "other", "10Gi", device="gpu-1")
    prepare(w, other)  # answered while the wait goes on
    again = w.kubelet.prepare([new])[new.uid].error  # the kubelet's retry meanwhile
    assert again == (
        "an earlier prepare of this claim is still waiting for borrowed memory (burst "
        "reclaim); the kubelet retries"
    ), again
    assert waiting.is_alive() and reclaiming(w, a) and holder.alive()
    holder.stop()  # the borrower's pod ends
    assert w.kubelet.unprepare([a]) == {a.uid: ""}
    waiting.join(DEADLINE)
    assert answer == [""]
    assert w.plugin.driver.state.reclaims.outcomes == {"freed": 1, "evicted": 0, "timeout": 0}
    assert w.kubelet.unprepare([other, new]) == {other.uid: "", new.uid: ""}


def test_each_borrower_is_taken_back_under_its_own_gpus_policy(
    borrower_bin: Path, sim_env: dict[str, str], borrowers: list[Borrower]
) -> None:
    """One claim needs memory on two GPUs whose policies differ: gpu-0 `evict` (grace 0.5 s),
    gpu-1 `wait` (timeout 40 s). Claim a borrows on gpu-0, b (newer) on gpu-1, both deaf. a's
    process is stopped after its grace while the prepare still waits for b, whose process is
    not stopped; once b's pod ends, the prepare answers. (Under one policy for both, that of
    whichever borrower came first, a would wait with b and never be stopped.)"""
    rules = {
        0: replace(BUILTIN, burst=Burst(max_ratio=8, from_claim=True, reclaim="evict", grace=0.5)),
        1: replace(BUILTIN, burst=Burst(max_ratio=8, from_claim=True, reclaim="wait", timeout=40)),
    }
    w = make_world(rules_for=lambda g: rules[g.index])
    try:
        a = claim(w, "a", "10Gi", "4x")
        b = claim(w, "b", "10Gi", "4x", device="gpu-1")
        prepare(w, a)
        prepare(w, b)
        deaf_a = start(borrower_bin, w, a, sim_env, "deaf", 6, 0, borrowers)
        deaf_b = start(borrower_bin, w, b, sim_env, "deaf", 6, 0, borrowers)
        assert used(w, a) == used(w, b) == 30 * GiB  # each borrows 20 of a grant of 30
        both = w.claim("both", results=[result("gpu", "gpu-0", memory="65Gi", cores="10"),
                                         result("gpu", "gpu-1", memory="65Gi", cores="10")])  # fmt: skip
        waiting, answer = prepare_in_background(w, both)
        assert deaf_a.proc.wait(DEADLINE) == -9  # gpu-0: evict, after the grace
        assert waiting.is_alive() and deaf_b.alive()  # gpu-1: wait stops nobody
        g = grant_of(w, b)
        assert g is not None and (g.state, g.grant, g.deadline_unix_ns) == (
            burstpool.GRANT_RECLAIM, 5 * GiB, 0)  # fmt: skip
        deaf_b.stop()
        waiting.join(DEADLINE)
        assert answer == [""]
        assert w.plugin.driver.state.reclaims.outcomes == {"freed": 0, "evicted": 1, "timeout": 0}
        (ev,) = events(w.server, a, "BurstReclaimed")
        assert f"processes stopped: {deaf_a.proc.pid}" in ev["message"], ev["message"]
    finally:
        close_world(w)


# ------------------------------------------------------ a borrower that hides what it borrows


def test_evict_measures_a_borrower_by_nvml_when_its_accounting_file_says_less(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower], host_nvml: HostNvml,
) -> None:  # fmt: skip
    """A deaf borrower holds 50 GiB (request 20, grant 40) and its tenant zeroes the charges in
    its accounting file: by the file it borrows nothing, by the host's NVML 30 GiB. A claim of
    40 GiB cuts its grant to 20: the plugin still stops it (it holds device memory by NVML's
    count, though its slot says nothing)."""
    w = nvml_world(worlds, host_nvml, reclaim="evict", grace=0.5)
    a = claim(w, "a", "20Gi", "3x")
    prepare(w, a)
    deaf = start(borrower_bin, w, a, sim_env, "deaf", 10, 0, borrowers)
    assert deaf.held == 10 and host_nvml.used(deaf.proc.pid) == 50 * GiB
    lower_used(w, a)
    prepare(w, claim(w, "b", "40Gi"))
    assert deaf.proc.wait(DEADLINE) == -9  # SIGKILL
    assert host_nvml.used(deaf.proc.pid) == 0
    (ev,) = events(w.server, a, "BurstReclaimed")
    assert f"processes stopped: {deaf.proc.pid}" in ev["message"], ev["message"]
    assert w.plugin.driver.state.reclaims.outcomes["evicted"] == 1


def test_wait_measures_a_borrower_by_nvml_when_its_accounting_file_says_less(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower], host_nvml: HostNvml,
) -> None:  # fmt: skip
    w = nvml_world(worlds, host_nvml, reclaim="wait", timeout=1.0)
    a = claim(w, "a", "20Gi", "3x")
    prepare(w, a)
    holder = start(borrower_bin, w, a, sim_env, "deaf", 10, 0, borrowers)
    lower_used(w, a)
    # the metric measures it as the reclaim does: by NVML, 50 GiB less the margin above 20
    borrowed = metrics(w)[("vgpu_slice_borrowed_bytes", ("default/a", "gpu-0"))]
    assert borrowed == 30 * GiB - 128 * 1024**2, borrowed
    new = claim(w, "train", "40Gi")
    err = w.kubelet.prepare([new])[new.uid].error
    # by NVML: 50 GiB held, less the margin (128 MiB), above request 20 and grant 20
    assert err == (
        "device gpu-0: 9.88 GiB of the 40.0 GiB this claim's request needs are borrowed by "
        "claim default/a and were not given back within 1s (burst reclaim: wait); the kubelet "
        "retries"
    ), err
    assert holder.alive() and not spec_path(w, new).exists()
    holder.stop()
    wait_for(lambda: host_nvml.used(holder.proc.pid) == 0, "the holder's memory is freed")
    prepare(w, new)


# -------------------------------------------------------------- SIGKILL of the plugin mid-reclaim


def test_a_plugin_killed_during_an_evict_finishes_it_at_its_next_start(
    borrower_bin: Path, sim_env: dict[str, str], borrowers: list[Borrower]
) -> None:
    root = Path(tempfile.mkdtemp(prefix="vgk", dir="/tmp"))  # short socket paths
    pol = root / "policy.yaml"
    pol.write_text(json.dumps({
        "apiVersion": "vgpu.sharing.dev/v1alpha1", "kind": "SharingPolicy",
        "default": {"burst": {"maxRatio": 4, "fromClaim": True, "reclaim": "evict",
                              "grace": "1s"}},
    }))  # fmt: skip
    server = FakeApiServer()
    server.up()
    plugin = PluginProcess(root, server.url, gpus=fake_gpus(), extra_args=("--policy", str(pol)))
    try:
        plugin.start()
        kubelet = KubeletStandin(plugin.root / "registry" / "vgpu.sharing.dev-reg.sock")
        kubelet.register()
        w = World(server, plugin, kubelet, root)  # type: ignore[arg-type]
        a = claim(w, "a", "20Gi", "3x")
        prepare(w, a)
        deaf = start(borrower_bin, w, a, sim_env, "deaf", 10, 0, borrowers)
        kubelet.close()
        plugin.stop()
        plugin.start(crash_at="reclaim-notice")
        kubelet.register()
        new = claim(w, "b", "40Gi")
        with pytest.raises(Exception):  # noqa: B017 (the plugin dies under the call)
            kubelet.prepare([new])
        assert plugin.wait_exit() == -9
        # killed after the notice, before the grace ran out: the borrower still holds it all
        assert deaf.alive() and used(w, a) == 50 * GiB
        g = grant_of(w, a)
        assert g is not None and g.state == burstpool.GRANT_RECLAIM and g.grant == 20 * GiB
        kubelet.close()
        plugin.start()  # READY only after the reclaim is finished
        assert deaf.proc.wait(DEADLINE) == -9 and used(w, a) == 0
        kubelet.register()
        prepare(w, new)  # the kubelet's retry
        assert granted(w, a) == 20 * GiB
        ckpt = json.loads((data_dir(w) / "checkpoint.json").read_text())
        assert not any("reclaim" in e for e in ckpt["claims"].values())
    finally:
        plugin.stop()
        server.down()
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------- never a byte of a prepared claim's request

SAMPLER = """
import json, sys, time
import pynvml as nv
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
pids = {int(p): c for p, c in (x.split("=") for x in sys.argv[1].split(","))}
samples = []
print("sampling", flush=True)
import select
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.monotonic()
    held = {}
    for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
        if p.pid in pids and p.usedGpuMemory is not None:
            held[pids[p.pid]] = held.get(pids[p.pid], 0) + p.usedGpuMemory
    samples.append([t0, time.monotonic(), held])
print(json.dumps(samples))
"""


def test_concurrent_prepares_never_let_a_borrower_use_a_prepared_claims_request(
    worlds: Callable[..., World], borrower_bin: Path, sim_env: dict[str, str],
    borrowers: list[Borrower],
) -> None:  # fmt: skip
    """Two greedy borrowers (each 10 GiB, limit 60 GiB; they allocate 1 GiB blocks whenever they
    can and free everything at each notice) while two threads prepare and unprepare claims of 30
    and 20 GiB over and over, concurrently. The simulated GPU's NVML (no shim) is sampled from
    outside throughout: at every sample, what the borrowers hold above their requests fits in
    80 GiB minus the requests of every claim prepared (answered, not yet unprepared) around it."""
    w = worlds(reclaim="evict", grace=2.0)
    a, b = claim(w, "a", "10Gi", "6x"), claim(w, "b", "10Gi", "6x")
    prepare(w, a)
    prepare(w, b)
    greedy = [start(borrower_bin, w, c, sim_env, "greedy", 50, 0, borrowers, chunk=1 * GiB)
              for c in (a, b)]  # fmt: skip
    owners = ",".join(f"{g.proc.pid}={c.name}" for g, c in zip(greedy, (a, b), strict=True))
    plain = {k: v for k, v in sim_env.items() if k != "LD_PRELOAD"}
    sampler = subprocess.Popen([sys.executable, "-c", SAMPLER, owners], env=plain, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    assert sampler.stdout is not None and sampler.stdout.readline().strip() == "sampling"
    # (claim request, prepared-answered time, unprepare-called time) of each prepared interval
    intervals: list[tuple[int, float, float]] = []
    lock = threading.Lock()
    errors: list[str] = []

    def grant(c: ClaimId) -> int:
        g = grant_of(w, c)  # OPEN, or RECLAIM while another prepare takes memory back
        assert g is not None
        return g.grant

    def churn(name: str, request: int, rounds: int) -> None:
        for i in range(rounds):
            c = claim(w, f"{name}-{i}", f"{request}Gi")
            err = w.kubelet.prepare([c])[c.uid].error
            answered = time.monotonic()
            if err:
                errors.append(err)
                continue
            # let the borrowers fill what they are granted while this claim is prepared (a
            # bounded look, not a condition of the test: grants move with the other thread,
            # whose prepare may be taking memory back meanwhile)
            until = time.monotonic() + 2.0
            while time.monotonic() < until and not all(
                used(w, c) >= 10 * GiB + grant(c) - GiB for c in (a, b)
            ):
                time.sleep(0.01)
            called = time.monotonic()
            assert w.kubelet.unprepare([c]) == {c.uid: ""}
            with lock:
                intervals.append((request * GiB, answered, called))

    threads = [threading.Thread(target=churn, args=("x", 30, 6)),
               threading.Thread(target=churn, args=("y", 20, 6))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE * 4)
    out, _ = sampler.communicate(input="\n", timeout=DEADLINE)
    samples = json.loads(out)
    assert not errors, errors
    assert len(intervals) == 12 and len(samples) > 100
    base = 20 * GiB  # a and b's requests
    borrowing, squeezed = 0, 0
    for t0, t1, held in samples:
        requested = base + sum(r for r, ans, call in intervals if ans < t0 and call > t1)
        over = sum(max(0, held.get(c.name, 0) - 10 * GiB) for c in (a, b))
        borrowing += over > 0
        squeezed += over > 0 and requested > base
        assert over <= 80 * GiB - requested, (t0, held, requested)
    # the rule was put to the test: borrowing while other claims were prepared
    assert borrowing > 0 and squeezed > 0, (borrowing, squeezed)

"""A tenant's GPU process makes its /proc files as large as it can (issue 33, attack 1): 58,000
mappings of a file with a 3,800-character path (a ~230 MB /proc/<pid>/maps), a million
descriptors (as many as its hard RLIMIT_NOFILE allows: 20,000 on machines whose root lacks
CAP_SYS_RESOURCE, past the readers' bound of 16,384 either way), or 6,000 mounts with 3,000-character mount points (~18 MB of mountinfo; each mount costs the
kernel more than the last, so 100,000 would take this test minutes). The
root plugin's watchdog inspects that process at every NVML pass. Run in a 384 MiB memory cgroup,
as the DaemonSet limits it, the plugin must stay up with its memory bounded, report the
process, and go on preparing and unpreparing claims.

Before the reads were bounded, the maps attack got the plugin OOM-killed within seconds."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sharing.logsafe import printable
from sharing.observe.procinfo import OPEN_FILES
from tests.fakes.apiserver import FakeApiServer
from tests.support.observers import only, scrape
from tests.support.plugin_e2e import claim_world, root, server, sim_ready
from tests.support.proc_attacker import FORGED_NAME, start_attacker

pytestmark = pytest.mark.slow

__all__ = ["root", "server", "sim_ready"]  # fixtures used by name
MiB = 1 << 20
LIMIT = 384 * MiB  # deploy/base/daemonset.yaml's memory limit for the plugin
# What a watchdog pass may add to the plugin's peak while it inspects the attacker: the bounded
# readers stream through 64 KiB buffers and keep only what they look for.
GROWTH_BOUND = 16 * MiB
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A cgroup v1 memory group limited to LIMIT (the test machines have cgroup v1 memory)."""
    if os.geteuid() != 0 or not (CGROUP_V1 / "cgroup.procs").exists():
        if os.environ.get("CI"):
            pytest.fail("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
        pytest.skip("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    cg = CGROUP_V1 / f"vgpu-test-{uuid.uuid4().hex[:12]}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(LIMIT))
        yield cg
    finally:
        for pid in (cg / "cgroup.procs").read_text().split():
            (CGROUP_V1 / "cgroup.procs").write_text(pid)  # leftovers back to the root group
        cg.rmdir()


def _peak(cg: Path) -> int:
    return int((cg / "memory.max_usage_in_bytes").read_text())


def _reset_peak(cg: Path) -> None:
    (cg / "memory.max_usage_in_bytes").write_text("0")


def _oom_kills(cg: Path) -> int:
    for line in (cg / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("mode", ["maps", "fds", "mounts"])
def test_a_tenant_sized_proc_file_costs_the_plugin_bounded_memory(
    sim_ready: None, server: FakeApiServer, root: Path, memory_cgroup: Path, mode: str
) -> None:
    attacker = None
    with claim_world(server, root, memory_cgroup) as w:
        try:
            for _ in range(3):  # the plugin warm: NVML passes, scrapes, a prepared claim
                scrape(w.url)
                time.sleep(1)
            before = _peak(memory_cgroup)
            _reset_peak(memory_cgroup)
            attacker = start_attacker(mode, root / "attack", w.env)
            if mode == "fds":
                assert len(os.listdir(f"/proc/{attacker.pid}/fd")) > OPEN_FILES
            line = w.wait_for_line(attacker.pid)
            time.sleep(3)  # more passes over the attacker's files (one a second)
            w.alive(f", OOM kills in its cgroup: {_oom_kills(memory_cgroup)}")
            peak = _peak(memory_cgroup)
            print(f"{mode}: plugin peak before {before / MiB:.0f} MiB, during {peak / MiB:.0f} MiB")
            assert _oom_kills(memory_cgroup) == 0
            assert peak < before + GROWTH_BOUND, (peak - before) / MiB
            assert "without the sharing shim" in line
            if mode in ("maps", "fds"):
                assert "too large to inspect" in line, line
            # stopped as a process without the shim (--watchdog-enforce kill)
            assert attacker.wait(30) != 0
            assert only(scrape(w.url), "vgpu_slice_memory_limit_bytes", claim_uid=w.uids[0])
        finally:
            if attacker is not None and attacker.poll() is None:
                attacker.kill()
                attacker.wait()


def test_a_process_name_cannot_forge_a_line_of_the_plugins_log(
    sim_ready: None, server: FakeApiServer, root: Path
) -> None:
    """argv[0] and comm are the tenant's: a newline in them must not split the watchdog's line
    (issue 33, attack 5), in the log or in the Event."""
    attacker = None
    with claim_world(server, root) as w:
        try:
            attacker = start_attacker("name", root / "attack", w.env)
            line = w.wait_for_line(attacker.pid)
            shown = printable(FORGED_NAME)
            assert shown == "x\\nWARNING forg"
            assert f"pid {attacker.pid} ({shown}, user " in line, line
            log = w.plugin.output()
            assert not any(x.startswith("WARNING forg") for x in log.splitlines()), log
            # the Event is posted by the plugin's event thread, after the line: wait for it
            deadline = time.monotonic() + 30
            while not (events := [e for e in server.objects("Event")
                                  if f"pid {attacker.pid} " in e["message"]]):  # fmt: skip
                assert time.monotonic() < deadline, ("no Event names the process within 30 s",
                                                     server.objects("Event"))  # fmt: skip
                time.sleep(0.1)
            assert all("\n" not in e["message"] and shown in e["message"] for e in events), events
        finally:
            if attacker is not None and attacker.poll() is None:
                attacker.kill()
                attacker.wait()

"""Bursting in the shim: the second bound (docs/policy.md, "Memory that bursts and is given back").

A slice may use its request, and above it only what its grant entry in the plugin's pool file says
(never more than its limit). Each test runs real processes on the simulated GPU with the shim
preloaded; the "plugin" is the test, writing the pool file with sharing/burstpool.py.

- The bound: request + min(limit - request, grant), read at every allocation, so a grant raised,
  lowered, or given to another claim (its key) takes effect at the slice's next allocation.
- What the slice sees: the request as the total (default), or its limit with the opt-in.
- Fail closed: a malformed or inconsistent burst setting, or a pool file that is not a pool file,
  refuses every CUDA call (one config-error line).
- Under the plugin's limits file, the pool file must be the plugin's read-only mount: the tenant's
  environment cannot name another pool or limit, the tenant cannot write its grant, and a pool
  file on a writable file system is refused.
- Several bursting slices storming allocations while the "plugin" moves the grants between them
  (lowering one before raising another, as the plugin does): at every sample of the host's NVML
  (outside every slice), the bytes the slices hold above their requests fit the pool.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sharing._region_cffi import ffi

from sharing import burstpool, region
from sharing.limitsfile import BurstLimit, render_limits_file
from tests.shim.test_isolation import mount_ro, run, shim_dir, write_limits  # noqa: F401
from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support.shim_ops import build_harness, parse_ops

pytestmark = NO_CONTEXT_MEMORY

MiB = 1 << 20
REQUEST = 64 * MiB
LIMIT = 256 * MiB
KEY = 4242
ENTRY = 5
OOM = "2"  # CUDA_ERROR_OUT_OF_MEMORY


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[burstpool.Pool]:
    path = tmp_path / "pool"
    burstpool.create(path)
    with burstpool.Pool(path, writable=True) as p:
        yield p


def pool_path(tmp_path: Path) -> Path:
    return tmp_path / "pool"


def grant(p: burstpool.Pool, nbytes: int, *, key: int = KEY, entry: int = ENTRY,
          state: int = burstpool.GRANT_OPEN) -> None:  # fmt: skip
    p.write_grant(entry, key=key, device=0, state=state, request=REQUEST, limit=LIMIT, grant=nbytes)


def burst_env(shim_env: dict[str, str], tmp_path: Path, **extra: str) -> dict[str, str]:
    """A bursting slice configured from the environment (as `vgpu run` does)."""
    env = dict(
        shim_env,
        CUDA_DEVICE_MEMORY_LIMIT="64Mi",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "slice"),
        VGPU_MEMORY_BURST_LIMIT_0="256Mi",
        VGPU_BURST_GRANT_0=str(ENTRY),
        VGPU_BURST_KEY_0=str(KEY),
        VGPU_BURST_POOL=str(pool_path(tmp_path)),
    )
    env.update(extra)
    return env


def ops(binary: Path, env: dict[str, str], *args: str) -> tuple[list[dict[str, str]], str]:
    r = subprocess.run([str(binary), *args], env=env, capture_output=True, text=True, timeout=60)
    return parse_ops(r.stdout), r.stderr


class Stepper:
    """shim_ops with `step` ops: run() to the next step (the op lines so far), then the test changes
    the pool and the process goes on."""

    def __init__(self, binary: Path, env: dict[str, str], *args: str) -> None:
        self.proc = subprocess.Popen(
            [str(binary), *args], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    def run(self) -> list[dict[str, str]]:
        """Let it go on (after the first call) and return the op lines up to its next step."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        lines: list[str] = []
        for line in self.proc.stdout:
            if line.strip() == "step":
                return self._ops(lines)
            lines.append(line)
        return self._ops(lines)

    @staticmethod
    def _ops(lines: list[str]) -> list[dict[str, str]]:
        return [r for r in parse_ops("".join(lines)) if r["op"] != "step"]

    def go(self) -> list[dict[str, str]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.run()

    def finish(self) -> list[dict[str, str]]:
        out, err = self.proc.communicate(input="\n", timeout=60)
        assert self.proc.returncode == 0, err
        return self._ops(out.splitlines(keepends=True))


# ---------------------------------------------------------------- the bound


def test_a_slice_borrows_up_to_its_grant_and_no_further(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, pool: burstpool.Pool
) -> None:
    grant(pool, 64 * MiB)
    res, err = ops(shim_ops, burst_env(shim_env, tmp_path), "init", "ctx",
                   f"alloc:{64 * MiB}", f"alloc:{64 * MiB}", f"alloc:{2 * MiB}", "info", "total")  # fmt: skip
    rcs = [r["rc"] for r in res]
    assert rcs == ["0", "0", "0", "0", OOM, "0", "0"], (res, err)
    # request + grant = 128 MiB held; shown: the request as the total, nothing free
    assert res[5]["total"] == str(REQUEST) and res[5]["free"] == "0", res[5]
    assert res[6]["total"] == str(REQUEST)
    assert "denied, slice uses 128.0 MiB of 64.0 MiB requested + 64.0 MiB borrowable now" in err


def test_the_grant_is_read_at_every_allocation(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, pool: burstpool.Pool
) -> None:
    """Raised, lowered, given to another claim, taken back under reclaim: each change holds from the
    slice's next allocation on."""
    grant(pool, 0)
    s = Stepper(shim_ops, burst_env(shim_env, tmp_path),
                "init", "ctx", f"alloc:{64 * MiB}", f"alloc:{16 * MiB}", "step",
                f"alloc:{32 * MiB}", f"alloc:{16 * MiB}", "step",
                "free", f"alloc:{32 * MiB}", "step",
                f"alloc:{16 * MiB}", "step",
                f"alloc:{32 * MiB}", f"alloc:{1 * MiB}")  # fmt: skip
    first = s.run()
    assert [r["rc"] for r in first] == ["0", "0", "0", OOM], first  # grant 0: the request only
    grant(pool, 32 * MiB)
    second = s.go()
    assert [r["rc"] for r in second] == ["0", OOM], second  # 32 MiB borrowed, not 48
    grant(pool, 0)  # lowered
    third = s.go()
    assert [r["rc"] for r in third] == ["0", OOM], third  # freed 32 MiB; cannot borrow it again
    grant(pool, 1 << 40, key=KEY + 1)  # the entry given to another claim
    fourth = s.go()
    assert [r["rc"] for r in fourth] == [OOM], fourth
    grant(pool, 32 * MiB, state=burstpool.GRANT_RECLAIM)  # ours again, being taken back to 32 MiB
    last = s.finish()
    assert [r["rc"] for r in last] == ["0", OOM], last


def test_the_limit_caps_whatever_the_grant(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, pool: burstpool.Pool
) -> None:
    grant(pool, 1 << 40)  # a plugin bug, or a grant bigger than this claim's headroom
    res, _ = ops(shim_ops, burst_env(shim_env, tmp_path), "init", "ctx",
                 f"alloc:{256 * MiB}", f"alloc:{2 * MiB}")  # fmt: skip
    assert [r["rc"] for r in res] == ["0", "0", "0", OOM], res


def test_the_slice_sees_its_request_or_opts_in_to_see_its_limit(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, pool: burstpool.Pool
) -> None:
    grant(pool, 32 * MiB)
    steps = ("init", "ctx", "info", f"alloc:{80 * MiB}", "info", "total")
    plain, _ = ops(shim_ops, burst_env(shim_env, tmp_path), *steps)
    assert [(r.get("total"), r.get("free")) for r in plain if r["op"] in ("info", "total")] == [
        (str(REQUEST), str(REQUEST)), (str(REQUEST), "0"), (str(REQUEST), None)
    ]  # fmt: skip
    shown, _ = ops(shim_ops, burst_env(shim_env, tmp_path, VGPU_MEMORY_SHOW_LIMIT="1"), *steps)
    # total: the limit; free: what can be allocated now (request + grant - used)
    assert [(r.get("total"), r.get("free")) for r in shown if r["op"] in ("info", "total")] == [
        (str(LIMIT), str(96 * MiB)), (str(LIMIT), str(16 * MiB)), (str(LIMIT), None)
    ]  # fmt: skip


@pytest.mark.parametrize("lowered", [False, True])
def test_a_grant_lowered_while_an_allocation_is_charged_undoes_it(
    cbin_dir: Path, shim_env: dict[str, str], tmp_path: Path, pool: burstpool.Pool, lowered: bool
) -> None:
    """The plugin lowers a grant, then reads the slice's usage; the shim charges, then reads the
    grant again. Here the plugin's write lands exactly between the shim's charge and its second
    read (a hook of the test build): the charge is undone, the slice is back at its request."""
    harness = build_harness(cbin_dir, ["-DVGPU_TEST_HOOKS"])
    grant(pool, 64 * MiB)
    env = burst_env({k: v for k, v in shim_env.items() if k != "LD_PRELOAD"}, tmp_path)
    r = subprocess.run([str(harness), "burstrace", str(pool_path(tmp_path)), str(96 * MiB),
                        str(int(lowered))], env=env, capture_output=True, text=True, timeout=60,
                       check=True)  # fmt: skip
    got = dict(kv.split("=") for kv in r.stdout.split())
    if lowered:
        assert got == {"rc": "-1", "used": "0", "bound": str(REQUEST)}, r
    else:  # the same charge without the race: granted
        assert got == {"rc": "0", "used": str(96 * MiB), "bound": str(128 * MiB)}, r


# ---------------------------------------------------------------- fail closed


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"VGPU_MEMORY_BURST_LIMIT_0": "12x"}, "not a memory size"),
        ({"VGPU_MEMORY_BURST_LIMIT_0": "32Mi"}, "below the request"),
        ({"CUDA_DEVICE_MEMORY_LIMIT": None}, "without a memory limit"),
        ({"VGPU_BURST_POOL": None}, "no pool to borrow from"),
        ({"VGPU_BURST_GRANT_0": None}, "no pool to borrow from"),
        ({"VGPU_BURST_KEY_0": None}, "no pool to borrow from"),
        ({"VGPU_BURST_KEY_0": "0"}, "grant key 0"),
        ({"VGPU_BURST_GRANT_0": "1024"}, "past the pool's table"),
        ({"VGPU_BURST_GRANT_0": "-1"}, "not a whole number"),
        ({"VGPU_BURST_GRANT_1": "3"}, "a device without VGPU_MEMORY_BURST_LIMIT"),
        ({"VGPU_MEMORY_SHOW_LIMIT": "yes"}, "not a boolean"),
        ({"VGPU_BURST_POOL": "/nonexistent/pool"}, "burst pool file"),
    ],
)
def test_a_bad_burst_setting_fails_closed(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, pool: burstpool.Pool,
    change: dict[str, str | None], says: str,
) -> None:  # fmt: skip
    grant(pool, 1 << 30)
    env = burst_env(shim_env, tmp_path)
    for k, v in change.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    res, err = ops(shim_ops, env, "init", f"alloc:{1 * MiB}")
    assert res[0]["rc"] != "0", (res, err)  # cuInit refused: nothing runs
    lines = [x for x in err.splitlines() if x.startswith("vgpu:")]
    assert len(lines) == 1 and says in lines[0], err


@pytest.mark.parametrize("damage", ["short", "zeros", "version", "link"])
def test_a_file_that_is_not_a_pool_fails_closed(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, pool: burstpool.Pool, damage: str
) -> None:
    path = pool_path(tmp_path)
    grant(pool, 1 << 30)
    if damage == "short":
        os.truncate(path, burstpool.FILE_SIZE - 8)
    elif damage == "zeros":
        path.write_bytes(bytes(burstpool.FILE_SIZE))
    elif damage == "version":
        with path.open("r+b") as f:
            f.seek(ffi.offsetof("struct vgpu_pool_header", "layout_version"))
            f.write((99).to_bytes(4, "little"))
    else:
        real = tmp_path / "real-pool"
        path.rename(real)
        path.symlink_to(real)
    res, err = ops(shim_ops, burst_env(shim_env, tmp_path), "init", f"alloc:{1 * MiB}")
    assert res[0]["rc"] != "0", (res, err)
    assert "(burst pool file)" in err, err


# ---------------------------------------------------------------- the plugin's files


def plugin_limits(shim_dir: Path, acct: Path, pool: Path, **extra: str) -> None:  # noqa: F811
    text = render_limits_file(
        memory_limits=[REQUEST], sm_limits=[100], policy="hard", priority=1,
        shared_cache=str(acct), bursts=[BurstLimit(LIMIT, ENTRY, KEY)], burst_pool=str(pool),
    )  # fmt: skip
    write_limits(shim_dir, text + "".join(f"{k}={v}\n" for k, v in extra.items()))


def test_under_the_plugins_files_the_tenant_cannot_raise_its_grant(
    shim_ops: Path, shim_env: dict[str, str], shim_dir: Path, tmp_path: Path,  # noqa: F811
    pool: burstpool.Pool,
) -> None:  # fmt: skip
    """The pool file is the plugin's read-only mount: the tenant (root in its mount namespace)
    cannot write it, its environment cannot name another pool or limit, and rewriting its own
    accounting file does not lift request + grant for an allocation."""
    acct, path = tmp_path / "acct", pool_path(tmp_path)
    plugin_limits(shim_dir, acct, path)
    grant(pool, 32 * MiB)
    # the tenant's own pool, granting everything, named by its environment
    mine = tmp_path / "tenant-pool"
    burstpool.create(mine)
    with burstpool.Pool(mine, writable=True) as p:
        grant(p, 1 << 40)
    env = dict(shim_env, LD_PRELOAD=str(shim_dir / "libvgpu.so"), VGPU_BURST_POOL=str(mine),
               VGPU_MEMORY_BURST_LIMIT_0="1Ti", VGPU_BURST_GRANT_0=str(ENTRY))  # fmt: skip
    # what a root tenant tries first: write its grant in the mounted pool file
    offset = ffi.offsetof("struct vgpu_pool", "grants") + ENTRY * ffi.sizeof(
        "struct vgpu_pool_grant"
    ) + ffi.offsetof("struct vgpu_pool_grant", "grant")  # fmt: skip
    tamper = (
        f"{sys.executable} -c {shlex.quote(TAMPER)} {shlex.quote(str(path))} {offset}"
        f" > {shlex.quote(str(tmp_path / 'tamper'))}"
    )
    setup = mount_ro(shim_dir / "libvgpu.so", shim_dir / "limits", path) + " && " + tamper
    res, lines = run(shim_ops, env, "init", "ctx", f"alloc:{96 * MiB}", f"alloc:{2 * MiB}",
                     setup=setup)  # fmt: skip
    assert [r["rc"] for r in res] == ["0", "0", "0", OOM], (res, lines)
    assert (tmp_path / "tamper").read_text().strip() == "EROFS"
    assert pool.read_grant(ENTRY) == burstpool.Grant(KEY, 0, burstpool.GRANT_OPEN, REQUEST, LIMIT,
                                                      32 * MiB, 0)  # fmt: skip
    # the slice's accounting file zeroed by the tenant: one allocation above request + grant is
    # still refused (the same attack on the request alone: tests/shim/test_isolation.py)
    devices = ffi.offsetof("struct vgpu_region", "devices")
    end = ffi.offsetof("struct vgpu_region", "procs")
    with acct.open("r+b") as f:
        f.seek(devices)
        f.write(bytes(end - devices))
    res, _ = run(shim_ops, env, "init", "ctx", f"alloc:{97 * MiB}",
                 setup=mount_ro(shim_dir / "libvgpu.so", shim_dir / "limits", path))  # fmt: skip
    assert [r["rc"] for r in res] == ["0", "0", OOM], res


TAMPER = textwrap.dedent("""
    import errno, os, sys
    try:
        fd = os.open(sys.argv[1], os.O_RDWR)
        os.pwrite(fd, (1 << 40).to_bytes(8, "little"), int(sys.argv[2]))
        print("WROTE")
    except OSError as e:
        print(errno.errorcode[e.errno])
""")


def test_a_pool_file_that_is_not_the_plugins_mount_fails_closed(
    shim_ops: Path, shim_env: dict[str, str], shim_dir: Path, tmp_path: Path,  # noqa: F811
    pool: burstpool.Pool,
) -> None:  # fmt: skip
    acct, path = tmp_path / "acct", pool_path(tmp_path)
    plugin_limits(shim_dir, acct, path)
    grant(pool, 32 * MiB)
    env = dict(shim_env, LD_PRELOAD=str(shim_dir / "libvgpu.so"))
    # the limits file mounted, the pool file not: a file on a writable file system
    res, lines = run(shim_ops, env, "init", f"alloc:{1 * MiB}",
                     setup=mount_ro(shim_dir / "libvgpu.so", shim_dir / "limits"))  # fmt: skip
    assert res[0]["rc"] != "0", (res, lines)
    assert len(lines) == 1 and "not the plugin's" in lines[0], lines


# ---------------------------------------------------------------- several slices, one pool

SAMPLER = textwrap.dedent("""
    import json, sys
    import pynvml as nv
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    pids = {int(p): i for i, p in enumerate(sys.argv[2].split(","))}
    request, pool = int(sys.argv[1]), int(sys.argv[3])
    worst, n, over, seen = 0, 0, 0, 0
    print("sampling", flush=True)
    import select
    while not select.select([sys.stdin], [], [], 0)[0]:
        held = [0] * len(pids)
        for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid in pids and p.usedGpuMemory is not None:
                held[pids[p.pid]] += p.usedGpuMemory
        borrowed = sum(max(0, x - request) for x in held)
        worst, n = max(worst, borrowed), n + 1
        over += borrowed > pool
        seen += borrowed > 0
    print(json.dumps({"worst": worst, "samples": n, "over": over, "borrowing": seen}))
""")


def test_slices_storming_never_hold_more_than_the_pool_above_their_requests(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, pool: burstpool.Pool
) -> None:
    """Three slices, each request 64 MiB and limit 256 MiB, share a pool of 96 MiB. The test, as
    the plugin does, moves the whole pool from slice to slice: it lowers the holder's grant to 0,
    waits (polling its accounting file, with a deadline) until the slice uses no more than its
    request, then grants the pool to the next. Meanwhile each slice runs 4 threads of random
    cuMemAlloc/cuMemFree, and the host's NVML (no shim) is sampled from outside: the bytes held
    above the requests never exceed the pool."""
    pool_bytes = 96 * MiB
    slices = []
    for i in range(3):
        env = burst_env(
            shim_env, tmp_path, VGPU_BURST_GRANT_0=str(i), VGPU_BURST_KEY_0=str(100 + i)
        )
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(tmp_path / f"slice{i}")
        slices.append(env)
    for i in range(3):
        pool.write_grant(i, key=100 + i, device=0, state=burstpool.GRANT_OPEN, request=REQUEST,
                         limit=LIMIT, grant=0)  # fmt: skip
    plain = {k: v for k, v in shim_env.items() if k != "LD_PRELOAD"}
    procs = [
        subprocess.Popen(
            [str(shim_ops), "init", "ctx", f"storm:4:{12 * MiB}"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in slices
    ]
    for p in procs:
        assert p.stdout is not None
        for line in p.stdout:
            if line.strip() == "storming":
                break
    sampler = subprocess.Popen(
        [sys.executable, "-c", SAMPLER, str(REQUEST), ",".join(str(p.pid) for p in procs),
         str(pool_bytes)], env=plain, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert sampler.stdout is not None and sampler.stdout.readline().strip() == "sampling"
    holder, moves = 0, 0
    try:
        # the pool goes round the slices 5 times (no clock: a count of moves)
        while moves < 15:
            nxt = (holder + 1) % 3
            pool.write_grant(holder, key=100 + holder, device=0, state=burstpool.GRANT_RECLAIM,
                             request=REQUEST, limit=LIMIT, grant=0)  # fmt: skip
            deadline = time.monotonic() + 120
            while region.read(tmp_path / f"slice{holder}").devices[0].used > REQUEST:
                assert procs[holder].poll() is None, procs[holder].communicate()
                assert time.monotonic() < deadline, "the slice never came back to its request"
                time.sleep(0.001)
            pool.write_grant(nxt, key=100 + nxt, device=0, state=burstpool.GRANT_OPEN,
                             request=REQUEST, limit=LIMIT, grant=pool_bytes)  # fmt: skip
            holder, moves = nxt, moves + 1
            # until the new holder borrowed (its accounting file says so), with a deadline
            deadline = time.monotonic() + 120
            while region.read(tmp_path / f"slice{holder}").devices[0].used <= REQUEST:
                assert time.monotonic() < deadline, "the holder never borrowed"
                time.sleep(0.001)
    finally:
        outs = [p.communicate(input="", timeout=120) for p in procs]
        out, _ = sampler.communicate(input="stop\n", timeout=60)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    stress = [parse_ops(o)[-1] for o, _ in outs]
    assert result["over"] == 0 and result["worst"] <= pool_bytes, (result, moves)
    # the test saw what it checks: borrowing, the pool moved, every slice refused above its bound
    assert result["borrowing"] > 0 and result["samples"] > 0, result
    assert all(int(s["oom"]) > 0 and int(s["other"]) == 0 for s in stress), stress

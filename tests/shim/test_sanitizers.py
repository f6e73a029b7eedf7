"""The shim's own tests under AddressSanitizer + UndefinedBehaviorSanitizer: the harness compiled
sanitized, and the sanitized libvgpu.so preloaded (libasan first) into the CUDA test program."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from sharing import burstpool
from shim.build import SANITIZER_FLAGS
from tests.support.cbuild import compile_shared_library
from tests.support.lock_garbage import garbage_patterns, hold_hung_slot, scribble
from tests.support.quantity_cases import HAMI as CASES
from tests.support.shim_ops import REPO, build_harness, parse_ops

pytestmark = pytest.mark.slow

MiB = 1 << 20
SIM_LSAN_SUPP = Path(__file__).resolve().parents[1] / "sim" / "lsan.supp"
ASAN_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=99",
    "UBSAN_OPTIONS": "print_stacktrace=1",
}


def _libasan() -> str:
    out = subprocess.run(
        ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.fixture(scope="module")
def sanitized(
    tmp_path_factory: pytest.TempPathFactory, asan_libs: dict[str, Path]
) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("asan-harness")
    return {
        "shim": asan_libs["libvgpu.so"],
        "sim": asan_libs["libcuda.so.1"].parent,
        "harness": build_harness(d, list(SANITIZER_FLAGS)),
    }


def _clean(r: subprocess.CompletedProcess[str]) -> None:
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-3000:]


def _run_clean(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a program under the sanitizers; it must report nothing and exit 0."""
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    _clean(r)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_harness_sanitized(sanitized: dict[str, Path], tmp_path: Path) -> None:
    h = str(sanitized["harness"])
    env = {**ASAN_ENV, "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [h, "parse", *[t for t, _ in CASES]], env=env, capture_output=True, text=True, check=False
    )
    _clean(r)
    assert r.returncode == 0
    reg = str(tmp_path / "r.region")
    procs = [
        subprocess.Popen(
            [h, "stress", reg, "0", str(32 * MiB), "4", "5000"],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "Sanitizer" not in err, err[-3000:]
    r = subprocess.run([h, "lockdie", reg], env=env, capture_output=True, text=True, check=False)
    assert r.returncode == -signal.SIGKILL
    r = subprocess.run(
        [h, "used", reg, "0"], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    _clean(r)
    assert r.stdout.strip() == "0"


def test_shim_sanitized_in_a_cuda_program(
    sanitized: dict[str, Path], shim_ops: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    base = dict(sim_env, **ASAN_ENV)
    base["LD_PRELOAD"] = f"{_libasan()}:{sanitized['shim']}"
    # The simulator keeps destroyed handles on purpose (tests/sim/lsan.supp says which): the arrays
    # the shim creates and destroys to ask the driver an array's size are such handles.
    base["LSAN_OPTIONS"] = f"suppressions={SIM_LSAN_SUPP}:print_suppressions=0"
    reg = str(tmp_path / "s.region")
    pool = tmp_path / "pool"
    burstpool.create(pool)
    with burstpool.Pool(pool, writable=True) as bp:
        bp.write_grant(3, key=9, device=0, state=burstpool.GRANT_OPEN, request=64 * MiB,
                       limit=256 * MiB, grant=96 * MiB)  # fmt: skip
    many = tmp_path / "sim66.json"
    many.write_text(json.dumps({"devices": [{} for _ in range(66)]}))
    scenarios: list[tuple[dict[str, str], list[str]]] = [
        ({"CUDA_DEVICE_MEMORY_LIMIT": "64Mi", "CUDA_DEVICE_MEMORY_SHARED_CACHE": reg},
         ["init", "ctx", f"alloc:{60 * MiB}", f"alloc:{8 * MiB}", "info", "free", "alloc1:4096", "pitch:1000:100",
          "managed:4096", "create:2097152", "async:4096", "pool:4096", "newpool:4096", "array:64:64",
          "array3d:16:16:4", "mipmap:64:64:3", "ctxcreate", "total", "freeall", "info",
          "dlsym:cuMemAlloc_v2:1024", "procaddr:cuMemAlloc:12000:2:1024", "dlsym_is:cuMemFree_v2",
          "procaddr_is:cuMemAllocAsync:11020:2:cuMemAllocAsync_ptsz", "freeall",
          f"stress:4:2000:{4 * MiB}"]),
        ({"CUDA_DEVICE_MEMORY_LIMIT": "nonsense"}, ["init", "alloc:1024"]),
        # 64 KiB pages
        ({"CUDA_DEVICE_MEMORY_LIMIT": "64Mi", "CUDA_DEVICE_MEMORY_SHARED_CACHE": reg,
          "SIMGPU_ALLOC_GRANULARITY": "65536"},
         ["init", "ctx", "alloc:100", "pitch:3001:7", "array:64:64", "mipmap:64:64:3", "create:131072",
          "pool:4096", "freeall"]),
        # a device past the 64 accounted: refused on every path
        ({"CUDA_DEVICE_MEMORY_LIMIT": "64Mi", "CUDA_DEVICE_MEMORY_SHARED_CACHE": reg, "SIMGPU_CONFIG": str(many)},
         ["init", "ctx:65", "alloc:100", "pitch:1000:100", "array:64:64", "async:4096", "create:131072:65"]),
        ({"CUDA_DEVICE_MEMORY_LIMIT": "1Gi", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path)}, ["init"]),
        # bursting (docs/policy.md): every charge against request + grant, borrowing ones re-read
        ({"CUDA_DEVICE_MEMORY_LIMIT": "64Mi", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "b.region"),
          "VGPU_MEMORY_BURST_LIMIT_0": "256Mi", "VGPU_BURST_GRANT_0": "3", "VGPU_BURST_KEY_0": "9",
          "VGPU_BURST_POOL": str(pool), "VGPU_MEMORY_SHOW_LIMIT": "1", "SIMGPU_CONTEXT_MEMORY": "0"},
         ["init", "ctx", f"alloc:{100 * MiB}", "info", "pool:4096", f"alloc:{64 * MiB}", "freeall",
          f"stress:4:2000:{8 * MiB}"]),
        # VMM: released while mapped, mapped twice, a retained handle, a leak loop, odd calls
        ({"CUDA_DEVICE_MEMORY_LIMIT": "64Mi", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "v.region"),
          "SIMGPU_CONTEXT_MEMORY": "0"},
         ["init", "ctx", f"create:{8 * MiB}", f"map:{8 * MiB}", f"map:{8 * MiB}", "relh", "retain", "free",
          "free", f"twomaps:{4 * MiB}", "vmmodd", f"leak:{8 * MiB}:32", "freeall", "info"]),
        # a handed-over context size (too small): verified by the shim's own thread
        ({"CUDA_DEVICE_MEMORY_LIMIT": "4Gi", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "h.region"),
          "VGPU_CONTEXT_SIZE": "100Mi"},
         ["init", "ctx", "alloc:4096", "ctxcreate", "freeall"]),
    ]  # fmt: skip
    for extra, ops in scenarios:
        r = _run_clean([str(shim_ops), *ops], {**base, **extra})
        res = parse_ops(r.stdout)
        assert res[-1]["op"] == ops[-1].split(":")[0]
        if "VGPU_BURST_POOL" in extra:  # it borrowed: 100 MiB of a 64 MiB request
            assert res[2]["rc"] == "0" and res[3]["total"] == str(256 * MiB), res


def test_shim_sanitized_over_graph_memory_and_module_globals(
    sanitized: dict[str, Path], graphmem_ops: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """graphmem.c and modules.c under the sanitizers: memory nodes added and captured, launched
    (auto-free relaunch, refusal over quota), freed and trimmed; modules loaded every way and
    released by unload, context destruction and primary context reset."""
    env = dict(sim_env, **ASAN_ENV, CUDA_DEVICE_MEMORY_LIMIT="256Mi")
    env["SIMGPU_CONTEXT_MEMORY"] = "0"  # the quota is the graphs' (contexts: the run above)
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(tmp_path / "g.region")
    env["LD_PRELOAD"] = f"{_libasan()}:{sanitized['shim']}"
    # the simulator keeps destroyed graphs, execs and modules on purpose (its own suppressions)
    env["LSAN_OPTIONS"] = (
        f"suppressions={REPO / 'tests' / 'sim' / 'lsan.supp'}:print_suppressions=0"
    )
    ptx = tmp_path / "m.ptx"
    ptx.write_text(
        ".version 8.0\n.target sm_80\n.visible .global .b8 g[4096];\n.const .b8 c[64];\n"
    )
    ops = ["init", "route:procaddr", "gnew", "gnode:4096", "gfreenode", "gnode:65536", "inst:1", "launch",
           "launch", "touch", "memfree", "execdestroy", "gdestroy", "gnew", f"gnode:{512 * MiB}", "inst",
           "launch", "execdestroy", "gdestroy", "capbegin", "capalloc:8192", "capfree", "capalloc:100",
           "capend", "inst", "launch", "freeasync", "trim", "gattr", "route:dlsym", f"modload:{ptx}",
           f"modfile:{ptx}", f"fatload:{ptx}", f"libload:{ptx}", f"libfile:{ptx}", "libunload", "libunload",
           "modunload", "modunload", "ctxnew", f"modload:{ptx}", "ctxdestroy", f"modload:{ptx}", "preset",
           "info"]  # fmt: skip
    r = _run_clean([str(graphmem_ops), *ops], env)
    res = parse_ops(r.stdout)
    assert [x["op"] for x in res] == [o.split(":")[0] for o in ops]
    assert [x["rc"] for x in res if x["op"] == "launch"] == ["0", "0", "2", "0"], r.stdout
    assert all(x["rc"] == "0" for x in res if x["op"] != "launch"), r.stdout


def test_lock_takeover_sanitized(sanitized: dict[str, Path], tmp_path: Path) -> None:
    """Garbage over the region's lock: the sanitized harness takes it over (no hang, no report)."""
    h = str(sanitized["harness"])
    env = {**ASAN_ENV, "PATH": "/usr/bin:/bin"}
    reg = tmp_path / "g.region"
    _run_clean([h, "used", str(reg), "0"], env)
    hung = hold_hung_slot(reg)
    try:
        for i, pattern in enumerate(garbage_patterns()):
            scribble(reg, pattern)
            r = _run_clean([h, "stress", str(reg), "0", str(32 * MiB), "2", "2000"], env)
            if i == 0:  # a live slot's token: only the timeout tells
                assert "held for more than 2 s" in r.stderr, r.stderr[-3000:]
    finally:
        os.close(hung)


def test_bypass_routes_sanitized(
    sanitized: dict[str, Path],
    build_c: Callable[..., Path],
    cbin_dir: Path,
    sim_env: dict[str, str],
) -> None:
    """dlsym(RTLD_NEXT) behind the shim, and dlmopen, with the sanitized shim preloaded."""
    hostile = compile_shared_library("bypass_lib.c", cbin_dir, "libvgpu_bypass_test.so")
    main = build_c("bypass_main.c", ["-ldl"])
    env = dict(sim_env, **ASAN_ENV, CUDA_DEVICE_MEMORY_LIMIT="1Gi")
    env["LD_PRELOAD"] = f"{_libasan()}:{sanitized['shim']}"
    ops = [f"alloc:{2 << 30}:next", "nvml:next", "hook:next:cuMemFree_v2", f"alloc:{2 << 30}:dlmopen_new",
           f"alloc:{2 << 30}:dlmopen_dep:{hostile}"]  # fmt: skip
    r = _run_clean([str(main), str(hostile), *ops], env)
    rcs = [
        line.split("rc=")[1].split()[0]
        for line in r.stdout.splitlines()
        if line.startswith("op=alloc")
    ]
    assert rcs == ["2", "2", "-1"], r.stdout


def test_shared_vmm_across_processes_sanitized(
    sanitized: dict[str, Path], shim_ops: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """The shim and the simulator sanitized in two processes sharing VMM allocations: one creates,
    exports and releases, the other imports and maps until its slice's quota refuses."""
    env = dict(sim_env, **ASAN_ENV, SIMGPU_CONTEXT_MEMORY="0", CUDA_DEVICE_MEMORY_LIMIT="64Mi")
    env["LD_PRELOAD"] = f"{_libasan()}:{sanitized['shim']}"
    env["LD_LIBRARY_PATH"] = str(sanitized["sim"])
    env["LSAN_OPTIONS"] = f"suppressions={SIM_LSAN_SUPP}:print_suppressions=0"
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(tmp_path / "x.region")
    with tempfile.TemporaryDirectory(prefix="vmm") as d:
        sock = f"{d}/s"
        taker = subprocess.Popen(
            [str(shim_ops), "init", "ctx", f"take:{8 * MiB}:{sock}", "freeall"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            sharer = _run_clean(
                [str(shim_ops), "init", "ctx", f"share:{8 * MiB}:32:{sock}", "vmmodd", "freeall"],
                env,
            )
        finally:
            out, err = taker.communicate(timeout=300)
    _clean(subprocess.CompletedProcess(taker.args, taker.returncode, out, err))
    assert taker.returncode == 0, err[-3000:]
    shared, took = parse_ops(sharer.stdout)[2], parse_ops(out)[2]
    assert (shared["ok"], shared["rc"], took["ok"], took["rc"]) == ("7", "2", "7", "2")

"""The simulator built with AddressSanitizer + UndefinedBehaviorSanitizer (shim.build's flags).

The C programs are sanitized too (LeakSanitizer on, with the intentional handle retention in
lsan.supp suppressed); pynvml's Python host is not, so the sanitizer runtimes are preloaded there
and leak checking is off (the interpreter's own allocations would drown it).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from shim.build import CFLAGS as BUILD_CFLAGS
from shim.build import INCLUDE_DIR, LIBRARIES, SANITIZER_FLAGS, link_args
from tests.sim.simhelp import EXACT_BYTES, EXACT_DURATIONS, Client, run_python, tool_info
from tests.support.cbuild import C_PROGRAMS, CFLAGS, INCLUDE

# building the sanitized simulator and programs takes minutes on a loaded machine
pytestmark = [pytest.mark.slow, EXACT_BYTES, pytest.mark.timeout(1200)]


HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sanitized(
    tmp_path_factory: pytest.TempPathFactory, asan_libs: dict[str, Path]
) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("asan-programs")
    libdir = asan_libs["libcuda.so.1"].parent
    progs = {}
    programs: tuple[tuple[str, list[str]], ...] = (
        ("sim_api", ["-ldl"]),
        ("sim_client_api", []),
        ("sim_tool", []),
        ("sim_threads", []),
        ("graphmem_ops", ["-ldl"]),
    )
    for name, extra in programs:
        exe = out / name
        subprocess.run(
            [
                "gcc",
                *CFLAGS,
                *SANITIZER_FLAGS,
                f"-I{INCLUDE}",
                "-o",
                str(exe),
                str(C_PROGRAMS / f"{name}.c"),
                f"-L{libdir}",
                "-l:libcuda.so.1",
                *extra,
            ],
            check=True,
        )
        progs[name] = exe
    return {"libdir": libdir, **progs}


def _env(sim_env: dict[str, str], libdir: Path, leaks: bool) -> dict[str, str]:
    env = dict(sim_env, **EXACT_DURATIONS)  # the programs pin modelled durations
    env["LD_LIBRARY_PATH"] = str(libdir)
    env["ASAN_OPTIONS"] = f"detect_leaks={int(leaks)}:abort_on_error=0:halt_on_error=1:exitcode=23"
    env["LSAN_OPTIONS"] = f"suppressions={HERE / 'lsan.supp'}:print_suppressions=0"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1:exitcode=24"
    return env


@pytest.mark.parametrize("program", ["sim_api", "sim_client_api"])
def test_api_surface_is_sanitizer_clean(
    sanitized: dict[str, Path], sim_env: dict[str, str], program: str
) -> None:
    env = _env(sim_env, sanitized["libdir"], leaks=True)
    r = subprocess.run(
        [str(sanitized[program])], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr[-6000:]
    assert r.stdout.strip().endswith("OK")
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-6000:]


def test_graph_memory_and_module_globals_are_sanitizer_clean(
    sanitized: dict[str, Path], sim_env: dict[str, str], tmp_path: Path
) -> None:
    """Memory nodes added and captured, launched, freed by free nodes, cuMemFree and auto-free,
    graphs and execs destroyed before and after their allocations; module globals loaded and
    unloaded (tests/c/graphmem_ops.c). Graphs are kept after destroy by design: leaks off."""
    ptx = tmp_path / "m.ptx"
    ptx.write_text(".version 8.0\n.target sm_80\n.address_size 64\n.visible .global .b8 g[4096];\n")
    ops = ["init", "gnew", "gnode:4096", "gfreenode", "gnode:65536", "inst:1", "launch", "launch",
           "touch", "execdestroy", "gdestroy", "memfree", "capbegin", "capalloc:8192", "capfree",
           "capalloc:100", "capend", "inst:1", "launch", "gdestroy", "launch", "touch", "execdestroy",
           "trim", "gattr", f"modload:{ptx}", f"modfile:{ptx}", f"libload:{ptx}", "libunload",
           "modunload", "modunload", f"fatload:{ptx}", "modunload", f"libfile:{ptx}", "libunload", "info"]  # fmt: skip
    env = _env(sim_env, sanitized["libdir"], leaks=False)
    r = subprocess.run(
        [str(sanitized["graphmem_ops"]), *ops], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr[-6000:]
    assert all(" rc=0" in line for line in r.stdout.splitlines()), r.stdout
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-6000:]


def test_threads_are_sanitizer_clean(sanitized: dict[str, Path], sim_env: dict[str, str]) -> None:
    env = _env(sim_env, sanitized["libdir"], leaks=True)
    r = subprocess.run(
        [str(sanitized["sim_threads"])], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr[-6000:]
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-6000:]
    # every thread's memory came back (exact bytes, no context memory: EXACT_BYTES)
    assert f"free after={80 << 30}" in r.stdout, r.stdout


def test_threads_are_threadsanitizer_clean(sim_env: dict[str, str], tmp_path: Path) -> None:
    """ThreadSanitizer over the multi-threaded program. Only the simulator's libraries are built
    (with shim.build's sources and flags): the interposer is not part of this program."""
    out = tmp_path / "sim"
    out.mkdir()
    for lib in LIBRARIES:
        if lib.subdir != "sim":
            continue
        subprocess.run(
            [
                "gcc",
                *BUILD_CFLAGS,
                "-fsanitize=thread",
                f"-I{INCLUDE_DIR}",
                "-shared",
                "-o",
                str(out / lib.filename),
                *map(str, lib.sources()),
                *link_args(lib),
                *[f"-l{x}" for x in lib.libs],
            ],
            check=True,
        )
    exe = tmp_path / "sim_threads"
    subprocess.run(
        [
            "gcc",
            *CFLAGS,
            "-fsanitize=thread",
            f"-I{INCLUDE}",
            "-o",
            str(exe),
            str(C_PROGRAMS / "sim_threads.c"),
            f"-L{out}",
            "-l:libcuda.so.1",
        ],
        check=True,
    )
    env = dict(sim_env, LD_LIBRARY_PATH=str(out), TSAN_OPTIONS="halt_on_error=1:exitcode=25")
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-6000:]
    assert "ThreadSanitizer" not in r.stderr, r.stderr[-6000:]
    assert f"free after={80 << 30}" in r.stdout, r.stdout  # every thread's memory came back


def test_multiprocess_paths_are_sanitizer_clean(
    sanitized: dict[str, Path], sim_env: dict[str, str]
) -> None:
    env = _env(sim_env, sanitized["libdir"], leaks=True)
    tool = sanitized["sim_tool"]
    victim = Client(tool, env, "hold", str(10**9))
    fork = Client(tool, env, "fork", str(10**9))
    os.kill(victim.pid, signal.SIGKILL)
    victim.proc.wait(10)
    assert tool_info(tool, env)[0] == (80 << 30) - 2 * 10**9
    assert fork.finish() == 0, fork.proc.stderr.read() if fork.proc.stderr else ""
    load = subprocess.run(
        [str(tool), "load", "200", "4", "8", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert load.returncode == 0, load.stderr[-4000:]
    # NVML through pynvml, with the sanitizer runtimes preloaded into the (unsanitized) interpreter
    runtimes = [
        subprocess.run(
            ["gcc", f"-print-file-name={lib}"], capture_output=True, text=True, check=True
        ).stdout.strip()
        for lib in ("libasan.so", "libubsan.so")
    ]
    penv = _env(sim_env, sanitized["libdir"], leaks=False)
    penv["LD_PRELOAD"] = " ".join(runtimes)
    got = run_python(
        penv,
        """
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
s = nv.nvmlEventSetCreate()
nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, s)
try:
    nv.nvmlEventSetWait_v2(s, 100)
except nv.NVMLError_Timeout:
    pass
nv.nvmlEventSetFree(s)
print(json.dumps([nv.nvmlDeviceGetMemoryInfo(h).used, text(nv.nvmlDeviceGetName(h)),
                  nv.nvmlDeviceGetUtilizationRates(h).gpu, len(procs)]))
""",
    )
    assert got[0] == 0 and got[1] == "NVIDIA H100 80GB HBM3" and got[3] == 0


def test_config_parser_fuzz_is_sanitizer_clean(
    sanitized: dict[str, Path], sim_env: dict[str, str], tmp_path: Path
) -> None:
    """Mutated config files (truncation, byte flips, deep nesting, escapes, huge numbers) never
    crash the parser: cuInit either works or fails with at most one line."""
    import json
    import random

    rng = random.Random(1234)
    base = json.dumps(
        {
            "devices": [
                {
                    "name": "NVIDIA H100 \\u00e9 \\ud83d\\ude00",
                    "uuid": "GPU-11111111-2222-4333-8444-555555555555",
                    "memory": "80Gi",
                    "sm_count": 132,
                    "pci_bus_id": "0000:18:00.0",
                    "numa_node": 0,
                    "compute_capability": "9.0",
                    "healthy": True,
                    "xid": 79,
                    "minor": 0,
                },
                {"memory": 12345678},
            ],
            "driver_version": "570.172.08",
            "cuda_version": "12.8",
        }
    ).replace("\\\\u", "\\u")
    cases = [
        base,
        "[" * 5000,
        "{" * 70 + "}" * 70,
        '{"devices": [' + "[" * 100,
        '"\\ud800"',
        '{"a": 1e999999}',
        '{"devices": [{"memory": 184467440737095516160}]}',
        '{"devices": [{"memory": "99999999999999999999Ti"}]}',
        "\x00",
        '{"devices": []}',
        " \n\t{} ",
        '{"devices":[{"name":"a\\x"}]}',
        '{"devices": [{"name": "a\\"'
        + "b" * 300
        + '"}]}',  # an escaped quote does not end the string
        '{"devices": [{"name": "' + '\\"' * 40 + "\\u00e9" * 10 + '"}]}',
    ]
    for _ in range(80):
        b = bytearray(base.encode())
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(b))
            if op < 0.4:
                b[pos] = rng.randrange(256)
            elif op < 0.7:
                del b[pos : pos + rng.randint(1, 8)]
            else:
                b[pos:pos] = rng.choice(
                    [b"{", b"[", b'"', b"\\", b",", b":", b"-", b"9" * 30, b"\\u12", b"\xff"]
                )
        cases.append(b.decode("latin-1"))
    env = _env(sim_env, sanitized["libdir"], leaks=True)
    cfg = tmp_path / "fuzz.json"
    ok = 0
    for text in cases:
        cfg.write_bytes(text.encode("latin-1"))
        r = subprocess.run(
            [str(sanitized["sim_tool"]), "init"],
            env=dict(env, SIMGPU_CONFIG=str(cfg)),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=60,
        )
        assert r.returncode == 0, (text[:200], r.returncode, r.stderr[-3000:])
        code = r.stdout.strip()
        lines = r.stderr.strip().splitlines()
        if code == "0":
            ok += 1
            assert lines == [], (text[:200], r.stderr)
        elif not lines:
            assert code == "100" and json.loads(text)["devices"] == [], text[
                :200
            ]  # a node without GPUs
        else:
            assert len(lines) == 1 and "allowed:" in lines[0], (text[:200], r.stderr)
    assert ok >= 1  # the unmutated base config loads


def test_observing_wrecked_states_is_sanitizer_clean(
    sanitized: dict[str, Path], sim_env: dict[str, str], tmp_path: Path
) -> None:
    """NVML observing (SIMGPU_OBSERVE) states a writer wrecked: random bytes, a forged state (a
    valid header, everything after it random, every slot lock held: every slot is read and
    its rings and scheduler state run forward), one cut in half, one emptied; under ASan and
    UBSan every view answers."""
    import contextlib
    import fcntl
    import struct

    env = _env(sim_env, sanitized["libdir"], leaks=False)
    root = tmp_path / "observed"
    tool = sanitized["sim_tool"]
    names = ("ok", "random", "forged", "half", "empty")
    holders = []
    for name in names:
        (root / name).mkdir(parents=True)
        holders.append(Client(tool, dict(env, SIMGPU_STATE=str(root / name)), "hold", str(10**9)))
    lock_fd = -1
    try:
        for name in names[1:]:
            [f] = [p for p in (root / name).iterdir() if "." not in p.name]
            size = f.stat().st_size
            if name in ("half", "empty"):
                os.truncate(f, size // 2 if name == "half" else 0)
                continue
            with f.open("r+b") as w:
                w.seek(0 if name == "random" else 16)
                left = size - w.tell()
                while left > 0:
                    n = min(left, 8 << 20)
                    w.write(os.urandom(n))
                    left -= n
            if name == "forged":
                lock_fd = os.open(f, os.O_RDWR)
                for slot in range(128):
                    lock = struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, (1 << 30) + slot, 1, 0)
                    with contextlib.suppress(BlockingIOError):  # the holder's own slot
                        fcntl.fcntl(lock_fd, 37, lock)  # F_OFD_SETLK
        runtimes = [
            subprocess.run(
                ["gcc", f"-print-file-name={lib}"], capture_output=True, text=True, check=True
            ).stdout.strip()
            for lib in ("libasan.so", "libubsan.so")
        ]
        penv = dict(env, LD_PRELOAD=" ".join(runtimes), SIMGPU_OBSERVE=str(root))
        got = run_python(
            penv,
            """
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
procs = [[p.pid, p.usedGpuMemory] for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
util = nv.nvmlDeviceGetUtilizationRates(h).gpu
samples = [[s.pid, s.smUtil] for s in nv.nvmlDeviceGetProcessUtilization(h, 0)]
mem = nv.nvmlDeviceGetMemoryInfo(h)
print(json.dumps([procs, util, samples, mem.used, mem.total]))
""",
        )
        procs, util, samples, used, total = got
        assert [holders[0].pid, 10**9] in procs, got
        assert 10**9 <= used <= total and 0 <= util <= 100, got
        assert all(0 <= s <= 100 for _, s in samples), got
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
        for h in holders:
            h.kill()

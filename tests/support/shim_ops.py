"""Running the shim's C test programs: the harness linked with the shim's sources, and
tests/c/shim_ops.c (CUDA calls by op) on the simulated GPU with the shim preloaded."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM_SRC = REPO / "shim" / "src"
INCLUDE = REPO / "shim" / "include"


def build_harness(out_dir: Path, extra: list[str]) -> Path:
    sources = sorted(SHIM_SRC.glob("*.c"))
    src = REPO / "tests" / "c" / "shim_harness.c"
    key = hashlib.sha256(
        b"".join(
            p.read_bytes()
            for p in [src, *sources, *sorted(SHIM_SRC.glob("*.[hd]*")), *sorted(INCLUDE.rglob("*"))]
            if p.is_file()
        )
        + " ".join(extra).encode()
    ).hexdigest()[:12]
    out = out_dir / f"shim_harness-{key}"
    if not out.exists():
        cmd = [
            "gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread",
            "-Wno-unused-parameter", *extra, f"-I{INCLUDE}", f"-I{SHIM_SRC}", "-o", str(out),
            str(src), *map(str, sources), "-ldl", "-lm",
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
    return out


def kv(stdout: str) -> dict[str, str]:
    """Parse 'key=value' tokens of a test program's output (last occurrence wins)."""
    out: dict[str, str] = {}
    for tok in stdout.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k] = v
    return out


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("CUDA_DEVICE_", "LIBCUDA_", "VGPU_", "SIMGPU_")) or k == "LD_PRELOAD":
            del env[k]
    return env


def parse_ops(stdout: str) -> list[dict[str, str]]:
    """One dict per 'op=... rc=...' line of shim_ops."""
    return [kv(line) for line in stdout.splitlines() if line.startswith("op=")]


def run_ops(
    binary: Path, env: dict[str, str], *ops: str, timeout: float = 120
) -> list[dict[str, str]]:
    r = subprocess.run(
        [str(binary), *ops], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert r.returncode == 0, f"rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r}"
    return parse_ops(r.stdout)


class Stepped:
    """A shim_ops process run a stretch at a time: its ops are separated by "step"s, and next()
    lets it run to the following one (or to its "ready") and returns the results of that
    stretch; end() lets it free what it holds and exit."""

    def __init__(self, binary: Path, env: dict[str, str], *ops: str) -> None:
        self.proc = subprocess.Popen(
            [str(binary), *ops, "ready", "freeall"],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.started = False
        self.stderr = ""

    def next(self) -> list[dict[str, str]]:
        """Let the process run to its next "step" (or "ready"): the results of the ops it ran."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.started:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        self.started = True
        lines: list[str] = []
        for line in self.proc.stdout:
            if line.strip() in ("step", "ready"):
                return parse_ops("".join(lines))
            lines.append(line)
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise AssertionError(f"shim_ops ended early: {lines} {err}")

    def end(self) -> list[dict[str, str]]:
        """Let it free what it holds and exit: the results of its last ops."""
        out, self.stderr = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, self.stderr
        return parse_ops(out)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=60)


class Held(Stepped):
    """A shim_ops process that ran its ops (no "step" among them) and now holds its allocations
    until release()."""

    def __init__(self, binary: Path, env: dict[str, str], *ops: str) -> None:
        super().__init__(binary, env, *ops)
        self.results = self.next()

    def release(self) -> list[dict[str, str]]:
        return self.end()


def device_used(binary: Path, env: dict[str, str], ordinal: int = 0) -> int:
    """Ground truth: the simulator's used bytes on a device, seen by a process without the shim."""
    plain = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    plain["SIMGPU_CONTEXT_MEMORY"] = "0"  # the observer's own context is not part of the answer
    res = run_ops(binary, plain, "init", f"ctx:{ordinal}", "info")
    assert res[-1]["rc"] == "0", res
    return int(res[-1]["used"])

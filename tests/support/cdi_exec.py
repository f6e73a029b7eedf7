"""Run a program as a container of a prepared claim would run, without a container runtime: in a
private mount namespace (unshare, root) where every mount of the claim's CDI spec is bound at its
container path (read-only where the spec says so), with the spec's environment, on the simulated
GPU. The container paths under /run and /usr/local/lib are made on tmpfs mounts private to the
namespace, so nothing appears on the host.

Not applied: device nodes (the simulated GPU needs none) and the preload list (the program gets
LD_PRELOAD naming the shim's container path instead, so the shell that sets up the mounts runs
without it); CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES are dropped (the plugin's GPUs are
stand-ins whose UUIDs the simulator does not know; its device 0 is the claim's).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from sharing.claimlayout import CONTAINER_LIB, CONTAINER_PRELOAD

_TMPFS = ("/run", "/usr/local/lib")
_DROPPED_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


def skip_unless_possible() -> None:
    """Outside CI, skip where a claim's mounts cannot be made; on CI (root, util-linux) fail."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        why = "needs root and unshare(1): a claim's files are read-only bind mounts"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI runs as root with util-linux)")
        pytest.skip(why)


def setup_script(spec: Mapping[str, Any]) -> str:
    """Shell commands that bind the spec's mounts at their container paths."""
    edits = spec["devices"][0]["containerEdits"]
    steps = [f"mount -t tmpfs tmpfs {d}" for d in _TMPFS]
    for m in edits.get("mounts", []):
        if m["containerPath"] == CONTAINER_PRELOAD:
            continue
        host, target = m["hostPath"], m["containerPath"]
        q = shlex.quote(target)
        make = f"mkdir -p {q}" if os.path.isdir(host) else (
            f"mkdir -p {shlex.quote(os.path.dirname(target))} && touch {q}"
        )  # fmt: skip
        ro = "-o ro " if "ro" in m.get("options", []) else ""
        steps += [make, f"mount --bind {ro}{shlex.quote(host)} {q}"]
    return " && ".join(steps)


def claim_env(spec: Mapping[str, Any], sim_env: Mapping[str, str]) -> dict[str, str]:
    edits = spec["devices"][0]["containerEdits"]
    env = {k: v for k, v in sim_env.items() if not k.startswith(("CUDA_", "VGPU_", "LD_PRELOAD"))}
    for e in edits.get("env", []):
        k, v = e.split("=", 1)
        if k not in _DROPPED_ENV:
            env[k] = v
    env["LD_PRELOAD"] = CONTAINER_LIB
    return env


def argv(spec: Mapping[str, Any], program: Sequence[str]) -> list[str]:
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'{setup_script(spec)} && exec "$@"', "sh", *program]  # fmt: skip


def popen(
    spec_path: Path, sim_env: Mapping[str, str], program: Sequence[str], **kw: Any
) -> subprocess.Popen[str]:
    """The program started in the claim's "container" (text pipes for stdin/stdout/stderr unless
    kw says otherwise)."""
    spec = json.loads(spec_path.read_text())
    kw.setdefault("stdin", subprocess.PIPE)
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(argv(spec, program), env=claim_env(spec, sim_env), text=True, **kw)

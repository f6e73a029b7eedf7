"""Running the C probe (shim/selftest/probe.c, built as sharing/_lib/vgpu-selftest-probe) as a
slice's process: the environment `vgpu run` gives a command (sharing/cli/run.py: the shim preloaded,
the limits set, the slice's accounting file), built by the same code, or none of it."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sharing.cli import run as vgpu_run
from sharing.paths import selftest_probe, shim_library, sim_lib_dir

log = logging.getLogger(__name__)

TIMEOUT_S = 300.0  # one probe run; far above any phase's length


class ProbeError(RuntimeError):
    """The probe could not run or reported a CUDA error. str() is one line."""


@dataclass(frozen=True)
class Runner:
    """How probe processes are started: on the simulator or the node's driver, with which shim."""

    workdir: Path
    sim: bool
    shim: Path | None  # None: the installed libvgpu.so

    def base_env(self) -> dict[str, str]:
        # No limits of an enclosing slice, and every GPU visible: --device names the physical GPU
        # by NVML index, which is the CUDA ordinal under CUDA_DEVICE_ORDER=PCI_BUS_ID.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CUDA_DEVICE_", "VGPU_")) and k != "CUDA_VISIBLE_DEVICES"
        }
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if self.sim:
            libs = [
                str(sim_lib_dir()),
                *[x for x in env.get("LD_LIBRARY_PATH", "").split(":") if x],
            ]
            env["LD_LIBRARY_PATH"] = ":".join(libs)
        return env

    def slice_env(
        self, name: str, memory: int = 0, compute: int = 0, **extra: str
    ) -> dict[str, str]:
        """A slice's environment exactly as `vgpu run --memory --compute --region` builds it."""
        argv = ["run", "--region", str(self.workdir / f"{name}.region")]
        if memory:
            argv += ["--memory", str(memory)]
        if compute:
            argv += ["--compute", str(compute)]
        if self.sim:
            argv.append("--sim")
        parser = argparse.ArgumentParser(prog="vgpu")
        vgpu_run.register(parser.add_subparsers())
        args = parser.parse_args([*argv, "--", "probe"])
        try:
            env = vgpu_run.build_env(args, self.base_env())
            vgpu_run.prepare_region(args, env)
        except vgpu_run.RunConfigError as e:
            raise ProbeError(f"slice {name}: {e}") from e
        if self.shim is not None:
            installed = str(shim_library())
            env["LD_PRELOAD"] = ":".join(
                str(self.shim) if x == installed else x for x in env["LD_PRELOAD"].split(":")
            )
        env.update(extra)
        return env

    def start(self, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
        cmd = [str(selftest_probe()), *args]
        log.debug("probe: %s", " ".join(cmd))
        return subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, env: dict[str, str], *args: str) -> dict[str, str]:
        """Run the probe to its end; its last key=value line. ProbeError when it fails."""
        p = self.start(env, *args)
        out, err = p.communicate(timeout=TIMEOUT_S)
        if p.returncode != 0:
            raise ProbeError(f"probe {args[0]} exited {p.returncode}: {last_line(err)}")
        return parse_kv(out)


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def parse_kv(text: str) -> dict[str, str]:
    """Every key=value pair of the probe's output; a later line's value wins."""
    kv: dict[str, str] = {}
    for line in text.splitlines():
        for tok in line.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                kv[k] = v
    return kv

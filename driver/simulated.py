"""`vgpu-kubelet-plugin --sim`: the packaged simulated GPU (docs/simulator.md) instead of NVIDIA's
driver, for a cluster without GPUs (scripts/cluster, deploy/overlays/sim).

The plugin and every claim's containers must see one simulated node, so this module lays it out
on the host, under the data dir (the same path inside the plugin and on the host):

    DATA/sim/lib/libcuda.so.1, libnvidia-ml.so.1   copies of the packaged simulator (0755),
                                                   mounted read-only into claims' containers
    DATA/sim/config.json                           the simulated devices (SIMGPU_CONFIG), 0644,
                                                   from --sim-gpus/--sim-model or --sim-config,
                                                   mounted read-only into claims' containers
    DATA/sim/plugin-state/                         0700 root: the plugin's own simulator state
                                                   (its NVML and its context-size helper),
                                                   never mounted into a claim (DATA/sim/state,
                                                   1777, was the node-wide state an older plugin
                                                   mounted into every claim: left to the claims
                                                   that still have it mounted, never used here)
    DATA/claims/<uid>/sim/                         1777 root, created at prepare and removed
                                                   with the claim's directory: the claim's own
                                                   simulator state (SIMGPU_STATE of its
                                                   processes: their memory and time slices),
                                                   mounted read-write into that claim alone

and points this process's NVML at it (SIMGPU_CONFIG, SIMGPU_STATE, the simulator's
libnvidia-ml.so.1 loaded first), observing every claim's state read-only (SIMGPU_OBSERVE =
DATA/claims/*/sim): the plugin's NVML lists every claim's processes and memory, as a kernel driver
sees every context, and whatever a tenant writes into its own state (truncation, garbage, a
process stopped holding the state's lock) cannot fault or block it (the simulator reads observed
states with pread, re-checking sizes, and never takes their locks). A tenant can wreck only its
own claim's simulated device. The cost: claims no longer contend for one simulated device (each
claim's processes time-slice a device of their own, and each sees the whole device's memory; the
shim's limits are what bound them), docs/driver.md "Simulated GPUs". `--dry-run --sim` uses a
temporary directory instead, so it needs no data dir.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from driver import hostfs
from sharing.fsutil import atomic_write
from sharing.gpus import use_simulator
from sharing.paths import sim_lib_dir

log = logging.getLogger(__name__)

SIM_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")
MAX_SIM_GPUS = 64  # the shim accounts 64 devices per process


@dataclass(frozen=True)
class SimModel:
    name: str  # as NVML reports it
    memory_mib: int  # as NVML reports the total
    sm_count: int
    compute_capability: str


# What NVML reports on these products (name, total memory, SMs, compute capability).
SIM_MODELS: dict[str, SimModel] = {
    "h100-80gb": SimModel("NVIDIA H100 80GB HBM3", 81559, 132, "9.0"),
    "a100-80gb": SimModel("NVIDIA A100-SXM4-80GB", 81920, 108, "8.0"),
    "a100-40gb": SimModel("NVIDIA A100-SXM4-40GB", 40960, 108, "8.0"),
    "l40s": SimModel("NVIDIA L40S", 46068, 142, "8.9"),
    "l4": SimModel("NVIDIA L4", 23034, 58, "8.9"),
    "t4": SimModel("Tesla T4", 15360, 40, "7.5"),
}
DEFAULT_SIM_MODEL = "h100-80gb"


def sim_uuid(node_name: str, index: int) -> str:
    """A GPU UUID of the simulated device `index` on `node_name`: stable across restarts and
    distinct between nodes (the simulator's default UUIDs are the same on every node)."""
    h = hashlib.sha256(f"{node_name}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def sim_config(node_name: str, gpus: int, model: str) -> dict[str, object]:
    """The simulator's device file (docs/simulator.md, SIMGPU_CONFIG) for `gpus` GPUs of `model`."""
    m = SIM_MODELS[model]
    return {
        "devices": [
            {
                "name": m.name,
                "uuid": sim_uuid(node_name, i),
                "memory": f"{m.memory_mib}Mi",
                "sm_count": m.sm_count,
                "compute_capability": m.compute_capability,
            }
            for i in range(gpus)
        ]
    }


# A claim's own simulator state directory, in the claim's directory (DATA/claims/<uid>/sim).
CLAIM_STATE_DIR = "sim"


@dataclass(frozen=True)
class SimNode:
    """Where the simulated node's files are, as the host (and so the CDI spec) names them."""

    lib_dir: Path
    config: Path
    state_dir: Path  # the plugin's own
    claims_dir: Path  # DATA/claims: each claim's state is <claims_dir>/<uid>/CLAIM_STATE_DIR

    def library(self, name: str) -> Path:
        return self.lib_dir / name

    @property
    def observe(self) -> str:
        """SIMGPU_OBSERVE of the plugin's NVML: every claim's state directory."""
        return f"{self.claims_dir}/*/{CLAIM_STATE_DIR}"

    def claim_state(self, claim_dir: Path) -> Path:
        """Create (or keep) the claim's own state directory in its claim directory: root's,
        sticky and writable by all (a claim's processes may run as any user: the simulator
        accepts such a directory and creates its state files there 0666), never through a link
        (driver/hostfs.py)."""
        with hostfs.open_dir(claim_dir) as dfd:
            hostfs.make_dir(dfd, CLAIM_STATE_DIR, 0o1777)
        return claim_dir / CLAIM_STATE_DIR


def config_bytes(node_name: str, gpus: int, model: str, config_file: Path | None) -> bytes:
    """The device file's contents: the admin's --sim-config as it is (the simulator checks it
    and names a bad field at the plugin's first NVML call), else one made of --sim-gpus and
    --sim-model."""
    if config_file is not None:
        return config_file.read_bytes()
    return (json.dumps(sim_config(node_name, gpus, model), indent=2) + "\n").encode()


def point_nvml_at(config: Path, state_dir: Path, observe: str | None = None) -> None:
    """This process's NVML is the simulator's, on the node `config` and `state_dir` describe
    (read by the simulator at every nvmlInit), seeing the states `observe` names read-only too
    (SIMGPU_OBSERVE, read at every query)."""
    os.environ["SIMGPU_CONFIG"] = str(config)
    os.environ["SIMGPU_STATE"] = str(state_dir)
    if observe is not None:
        os.environ["SIMGPU_OBSERVE"] = observe
    else:
        os.environ.pop("SIMGPU_OBSERVE", None)
    use_simulator()


def install(root: Path, content: bytes, claims_dir: Path) -> SimNode:
    """Lay the simulated node out under `root` (DATA/sim) and point NVML at it, observing the
    claims' states under `claims_dir`. Files are replaced atomically and only when changed,
    never through a link (driver/hostfs.py)."""
    node = SimNode(
        lib_dir=root / "lib",
        config=root / "config.json",
        state_dir=root / "plugin-state",
        claims_dir=claims_dir,
    )
    for d in (root, node.lib_dir):
        d.mkdir(mode=0o755, parents=True, exist_ok=True)
        _refuse_link(d)
    source = sim_lib_dir()
    for name in SIM_LIBRARIES:
        data = (source / name).read_bytes()
        if _current(node.library(name)) != data:
            atomic_write(node.library(name), data, mode=0o755)
            log.info("installed the simulator's %s -> %s", name, node.library(name))
    if _current(node.config) != content:
        atomic_write(node.config, content, mode=0o644)
    try:
        node.state_dir.mkdir(mode=0o700)
    except FileExistsError:
        _refuse_link(node.state_dir)
        if stat.S_IMODE(node.state_dir.stat().st_mode) != 0o700:
            os.chmod(node.state_dir, 0o700)  # the plugin's alone
    point_nvml_at(node.config, node.state_dir, node.observe)
    return node


def _current(path: Path) -> bytes | None:
    try:
        return hostfs.read_file(path)
    except OSError:
        return None


def _refuse_link(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        raise OSError(f"{path} must be a directory (not a link)")

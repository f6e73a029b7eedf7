"""Getting the NVIDIA driver's user-space files into a claim's containers on a CDI-only runtime
(containerd or CRI-O without the NVIDIA runtime hook).

Per claim, one of:
  toolkit  the NVIDIA Container Toolkit's CDI spec for the GPU exists on the node (kind
           `nvidia.com/gpu`, a device named by the GPU's UUID or index, in the CDI spec dirs):
           its device id goes back to the kubelet with the claim's own, and the toolkit's spec
           injects the driver;
  ours     otherwise the driver's files found under the driver root are mounted read-only at the
           same paths in the container: every `lib*.so.<driver version>` of the library
           directories (the version NVML reports; the NVIDIA installer names every user-space
           library so) under its own name and its soname links' names, the `nvidia-*` tools of
           the bin directories (nvidia-smi, ...), and the `/dev/nvidia*` control nodes (the GPUs'
           own nodes are the claim's, added by driver/claimspec.py). NVIDIA_VISIBLE_DEVICES=void
           then keeps a runtime hook, where one is installed, from injecting a second time.
  nothing  no driver files under the driver root (a node without the driver, the tests'
           default): the spec is left as it was and a warning logged once.
With `--sim` (driver/simulated.py) every claim instead gets the packaged simulated driver
(SimulatorInjector): its libcuda.so.1 and libnvidia-ml.so.1 where Debian/Ubuntu's loader finds
them and its device file, read-only, and a simulator state directory of the claim's own,
read-write (the plugin's NVML observes every claim's state read-only).

The driver root is seen by the plugin at `mount` (a read-only mount of the host's driver root,
`/driver-root` in the DaemonSet) and by the container runtime at `host` (`/`, or
`/run/nvidia/driver` under the GPU Operator); the CDI spec names host paths. Neither is a
tenant's directory, so links there are followed (the driver's soname links are links).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from cdi.spec import ContainerEdits, DeviceNode, Mount
from driver.simulated import SIM_LIBRARIES, SimNode
from sharing.gpus import GpuInfo

log = logging.getLogger(__name__)

TOOLKIT_KIND = "nvidia.com/gpu"
# Where distributions put 64-bit libraries and executables, relative to the driver root.
LIB_DIRS = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib64",
)
BIN_DIRS = ("usr/bin", "usr/local/bin", "bin")
_RO = ("ro", "nosuid", "nodev", "bind")
_SONAME = re.compile(r"^(lib[\w.+-]*?\.so)\.(\d+)$")
_GPU_NODE = re.compile(r"^nvidia\d+$")


@dataclass(frozen=True)
class DriverRoot:
    host: Path  # as the container runtime sees it (CDI host paths)
    mount: Path  # as this process sees it

    def host_path(self, rel: str) -> str:
        return str(self.host / rel)


@dataclass(frozen=True)
class Injection:
    """What a claim's spec and answer get beyond the claim's own edits."""

    cdi_ids: tuple[str, ...] = ()  # extra CDI device ids for the kubelet (the toolkit's)
    env: tuple[tuple[str, str], ...] = ()  # replaces a variable of the same name
    mounts: tuple[Mount, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    source: str = "none"  # toolkit | driver-root | simulator | none


NO_INJECTION = Injection()


def toolkit_devices(spec_dirs: Iterable[Path]) -> set[str]:
    """Device names of the toolkit's `nvidia.com/gpu` specs in the CDI spec dirs."""
    names: set[str] = set()
    for d in spec_dirs:
        try:
            files = sorted(d.iterdir())
        except OSError:
            continue
        for f in files:
            if f.suffix not in (".json", ".yaml", ".yml"):
                continue
            try:
                doc: Any = yaml.safe_load(f.read_text())
            except (OSError, yaml.YAMLError) as e:
                log.debug("CDI spec %s unreadable: %s", f, e)
                continue
            if not isinstance(doc, dict) or doc.get("kind") != TOOLKIT_KIND:
                continue
            for dev in doc.get("devices") or []:
                if isinstance(dev, dict) and isinstance(dev.get("name"), str):
                    names.add(dev["name"])
    return names


def driver_libraries(root: DriverRoot, version: str) -> list[tuple[str, list[str]]]:
    """(relative path of each `lib*.so.<version>`, [its name and its soname links' names])."""
    out: list[tuple[str, list[str]]] = []
    suffix = f".so.{version}"
    seen: set[Path] = set()
    for rel_dir in LIB_DIRS:
        d = root.mount / rel_dir
        try:
            if not d.is_dir() or d.resolve() in seen:
                continue  # /lib64 -> usr/lib64 and the like: each real directory once
            seen.add(d.resolve())
            entries = sorted(os.listdir(d))
        except OSError:
            continue
        libs = [e for e in entries if e.endswith(suffix) and not (d / e).is_symlink()]
        for lib in libs:
            names = [lib]
            for e in entries:
                m = _SONAME.match(e)
                if m and e != lib and (d / e).is_symlink() and _points_to(d, e, lib):
                    names.append(e)
            out.append((f"{rel_dir}/{lib}", names))
    return out


def _points_to(d: Path, name: str, target: str, hops: int = 4) -> bool:
    """True if the link d/name leads (by base names, within d) to target."""
    for _ in range(hops):
        try:
            name = os.path.basename(os.readlink(d / name))
        except OSError:
            return False
        if name == target:
            return True
    return False


def driver_tools(root: DriverRoot) -> list[str]:
    """Relative paths of the driver's `nvidia-*` executables (nvidia-smi, nvidia-debugdump...)."""
    out = []
    for rel_dir in BIN_DIRS:
        d = root.mount / rel_dir
        try:
            entries = sorted(os.listdir(d))
        except OSError:
            continue
        for e in entries:
            p = d / e
            if e.startswith("nvidia-") and p.is_file() and os.access(p, os.X_OK):
                out.append(f"{rel_dir}/{e}")
    return out


def control_nodes(dev_root: Path) -> list[str]:
    """`/dev/nvidia*` nodes that are not one GPU's (nvidiactl, nvidia-uvm, nvidia-modeset, the
    nvidia-caps directory's nodes), by name."""
    out = []
    try:
        entries = sorted(os.listdir(dev_root))
    except OSError:
        return []
    for e in entries:
        if not e.startswith("nvidia") or _GPU_NODE.match(e):
            continue
        p = dev_root / e
        if p.is_dir():
            out += [f"{e}/{c}" for c in sorted(os.listdir(p))]
        else:
            out.append(e)
    return out


class DriverInjector:
    """Decides and builds the driver injection of a claim's GPUs."""

    def __init__(
        self, root: DriverRoot | None, spec_dirs: Sequence[Path], dev_root: Path = Path("/dev")
    ) -> None:
        self.root = root
        self.spec_dirs = tuple(spec_dirs)
        self.dev_root = dev_root
        self._warned: set[str] = set()

    def for_gpus(self, gpus: Sequence[GpuInfo], claim_dir: Path | None = None) -> Injection:
        """The injection of a claim's GPUs; claim_dir: the claim's directory (DATA/claims/<uid>),
        where an injection may keep files of the claim's own."""
        toolkit = toolkit_devices(self.spec_dirs)
        ids = []
        for g in gpus:
            name = g.uuid if g.uuid in toolkit else str(g.index)
            if name not in toolkit:
                break
            ids.append(f"{TOOLKIT_KIND}={name}")
        else:
            if gpus:
                return Injection(cdi_ids=tuple(ids), source="toolkit")
        if self.root is None or not gpus:
            return Injection()
        version = gpus[0].driver_version
        libs = driver_libraries(self.root, version)
        if not libs:
            if version not in self._warned:
                self._warned.add(version)
                log.warning(
                    "no NVIDIA driver libraries lib*.so.%s under the driver root %s (seen at %s) "
                    "and no %s CDI spec in %s: containers get the driver only from an NVIDIA "
                    "runtime hook",
                    version,
                    self.root.host,
                    self.root.mount,
                    TOOLKIT_KIND,
                    ", ".join(map(str, self.spec_dirs)),
                )
            return Injection()
        mounts = [
            Mount(self.root.host_path(rel), "/" + str(Path(rel).parent / name), _RO)
            for rel, names in libs
            for name in names
        ]
        mounts += [
            Mount(self.root.host_path(rel), "/" + rel, _RO) for rel in driver_tools(self.root)
        ]
        nodes = tuple(
            DeviceNode(path=f"/dev/{n}", host_path=str(self.dev_root / n))
            for n in control_nodes(self.dev_root)
        )
        return Injection(
            env=(("NVIDIA_VISIBLE_DEVICES", "void"),),
            mounts=tuple(mounts),
            device_nodes=nodes,
            source="driver-root",
        )


# The simulated driver in a claim's containers (SimulatorInjector).
SIM_CONFIG_PATH = "/etc/vgpu-sim/config.json"
SIM_STATE_PATH = "/run/vgpu-sim"
_RW = ("rw", "nosuid", "nodev", "bind")


def multiarch_lib_dir(machine: str | None = None) -> str:
    """/usr/lib/<multiarch triplet> of this machine: where Debian/Ubuntu images' loader looks
    (without an ld.so.cache entry too), and where a Debian host keeps the real driver."""
    arch = machine or platform.machine()
    triplet = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(arch)
    if triplet is None:
        raise ValueError(f"architecture {arch!r} unsupported; allowed: x86_64, aarch64")
    return f"/usr/lib/{triplet}"


class SimulatorInjector(DriverInjector):
    """`--sim`: every claim gets the simulated driver of the node (driver/simulated.py):
    libcuda.so.1 and libnvidia-ml.so.1 read-only in the multiarch library directory, the device
    file read-only at SIM_CONFIG_PATH, and a simulator state directory of the claim's own
    (DATA/claims/<uid>/sim, created here) read-write at SIM_STATE_PATH, named by SIMGPU_CONFIG
    and SIMGPU_STATE. Nothing of another claim's or of the plugin's is writable: a tenant can
    wreck only its own claim's simulated device (docs/driver.md, "Simulated GPUs")."""

    def __init__(self, node: SimNode, machine: str | None = None) -> None:
        super().__init__(None, ())
        self.node = node
        self.lib_dir = multiarch_lib_dir(machine)

    def for_gpus(self, gpus: Sequence[GpuInfo], claim_dir: Path | None = None) -> Injection:
        if not gpus:
            return Injection()
        if claim_dir is None:
            raise ValueError("a simulated claim's injection needs its claim directory")
        libraries = [
            Mount(str(self.node.library(name)), f"{self.lib_dir}/{name}", _RO)
            for name in SIM_LIBRARIES
        ]
        mounts = (
            *libraries,
            Mount(str(self.node.config), SIM_CONFIG_PATH, _RO),
            Mount(str(self.node.claim_state(claim_dir)), SIM_STATE_PATH, _RW),
        )
        env = (
            ("SIMGPU_CONFIG", SIM_CONFIG_PATH),
            ("SIMGPU_STATE", SIM_STATE_PATH),
            ("NVIDIA_VISIBLE_DEVICES", "void"),
        )
        return Injection(env=env, mounts=mounts, source="simulator")


def find_nvml(root: DriverRoot) -> Path | None:
    """libnvidia-ml.so.1 under the driver root (for the plugin's own NVML), or None."""
    for rel_dir in LIB_DIRS:
        p = root.mount / rel_dir / "libnvidia-ml.so.1"
        if p.exists():
            return p
    return None


def load_driver_nvml(root: DriverRoot) -> Path | None:
    """Load the driver root's NVML into this process, where the plugin does not see the driver
    at its own root (the DaemonSet mounts the host's driver root at /driver-root). pynvml opens
    "libnvidia-ml.so.1" by soname; a library of that soname loaded first is the one it gets.
    Returns the path loaded, or None (NVML then comes from the usual search path)."""
    if root.mount == Path("/"):
        return None
    lib = find_nvml(root)
    if lib is None:
        log.warning("no libnvidia-ml.so.1 under the driver root mount %s", root.mount)
        return None
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    log.info("NVML: loaded %s", lib)
    return lib


def apply(edits: ContainerEdits, inj: Injection) -> ContainerEdits:
    """The claim's edits with the injection's: its env replaces same-named variables, its
    mounts and device nodes are added (a node the claim already has is not added twice)."""
    if not (inj.env or inj.mounts or inj.device_nodes):
        return edits
    overridden = dict(inj.env)
    env = tuple((k, overridden.pop(k, v)) for k, v in edits.env) + tuple(overridden.items())
    have = {n.path for n in edits.device_nodes}
    nodes = edits.device_nodes + tuple(n for n in inj.device_nodes if n.path not in have)
    return replace(edits, env=env, mounts=edits.mounts + inj.mounts, device_nodes=nodes)

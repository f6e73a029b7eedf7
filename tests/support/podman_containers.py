"""podman + runc as the CDI consumer, as a node runs containers: a root filesystem with the shim,
the simulator and the test's C programs; containers started from the CDI specs the plugin wrote
(podman in a private mount namespace where the plugin's CDI root is /var/run/cdi); and the world
of a plugin, a kubelet stand-in and podman the end-to-end tests claim in."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sharing.paths import ArtefactMissingError, shim_library, sim_lib_dir
from tests.driver.kubelet_standin import DRIVER, KubeletStandin
from tests.driver.plugin_process import PluginProcess, fake_gpus
from tests.fakes.apiserver import FakeApiServer
from tests.support.cbuild import compile_program

REPO = Path(__file__).resolve().parents[2]
RUNC = "/usr/sbin/runc"
# What the test program calls (the simulator must export all), and what the shim must hook.
CUDA_SYMBOLS = ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
                "cuMemGetInfo_v2", "cuMemAlloc_v2", "cuMemFree_v2")  # fmt: skip
SHIM_HOOKS = ("cuMemGetInfo_v2", "cuMemAlloc_v2")
NVML_SYMBOLS = ("nvmlInitWithFlags", "nvmlDeviceGetCount_v2", "nvmlDeviceGetUUID")
CUDA_ERROR_OUT_OF_MEMORY = 2
CONTAINER_SIM_LIB = "/usr/lib/vgpu-sim"
SIGNAL = "/signal"  # a directory of the test's, mounted into every container (markers)


def _exports(lib: Path) -> set[str]:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def missing_tools() -> str | None:
    for tool in ("podman", "unshare", "gcc", "nm", "ldd"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install podman runc util-linux gcc binutils)"
    if not Path(RUNC).exists():
        return f"{RUNC} is missing (apt-get install runc)"
    if os.geteuid() != 0:
        return "podman with --rootfs and a private mount namespace need root"
    try:
        shim_library(), sim_lib_dir()
    except ArtefactMissingError as e:
        return str(e)
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"cannot create a mount namespace: {probe.stderr.strip()}"
    return None


def missing_cuda() -> str | None:
    """Why the CUDA test program cannot run yet (shim or simulator incomplete), or None."""
    for lib, symbols in ((sim_lib_dir() / "libcuda.so.1", CUDA_SYMBOLS),
                         (sim_lib_dir() / "libnvidia-ml.so.1", NVML_SYMBOLS),
                         (shim_library(), SHIM_HOOKS)):  # fmt: skip
        missing = [s for s in symbols if s not in _exports(lib)]
        if missing:
            return f"{lib.name} does not export {', '.join(missing)} yet (not built/ready)"
    return None


def copy_with_deps(files: list[Path], rootfs: Path, env: dict[str, str]) -> None:
    """Copy the libraries the files need (per ldd) to the same paths under rootfs."""
    needed: set[str] = set()
    for f in files:
        out = subprocess.run(["ldd", str(f)], capture_output=True, text=True, env=env).stdout
        for line in out.splitlines():
            for word in line.split():
                if word.startswith("/") and Path(word).exists():
                    needed.add(word)
    for lib in needed:
        if lib.startswith(str(sim_lib_dir())):
            continue  # the simulator goes to its own directory below
        dest = rootfs / lib.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(lib).resolve(), dest)


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root filesystem with sh and cat, the shim's and the simulator's libraries, and the
    CUDA test program when the shim and simulator can run it."""
    why = missing_tools()
    if why:
        pytest.skip(why)
    rootfs = tmp_path_factory.mktemp("rootfs")
    (rootfs / "bin").mkdir()
    files = [shim_library(), *sim_lib_dir().iterdir()]
    for tool in ("sh", "cat"):
        path = Path(shutil.which(tool) or f"/bin/{tool}").resolve()
        shutil.copy2(path, rootfs / "bin" / tool)
        files.append(path)
    if missing_cuda() is None:
        program = compile_program(REPO / "tests" / "c" / "e2e_claim_quota.c",
                                  tmp_path_factory.mktemp("cbin"))  # fmt: skip
        shutil.copy2(program, rootfs / "bin" / "e2e_claim_quota")
        files.append(program)
    sim_dest = rootfs / CONTAINER_SIM_LIB.lstrip("/")
    sim_dest.mkdir(parents=True)
    for lib in sim_lib_dir().iterdir():
        shutil.copy2(lib, sim_dest / lib.name)
    for d in ("etc", "tmp", "run", "proc", "sys", "dev"):
        (rootfs / d).mkdir(exist_ok=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(sim_lib_dir()))
    copy_with_deps(files, rootfs, env)
    return rootfs


class Podman:
    def __init__(self, rootfs: Path, cdi_root: Path, sim_state: Path, signal: Path) -> None:
        self.rootfs = rootfs
        self.cdi_root = cdi_root
        self.sim_state = sim_state
        self.signal = signal  # the host side of /signal: the test's channel to a container

    def command(self, cdi_id: str, *args: str, program: str = "/bin/e2e_claim_quota") -> list[str]:
        podman = [
            "podman", "--runtime", RUNC, "--cgroup-manager=cgroupfs", "run", "--rm",
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
            "--network", "none",
            "--device", cdi_id,
            "-v", f"{self.sim_state}:{self.sim_state}",
            "-v", f"{self.signal}:{SIGNAL}",
            "-e", f"SIMGPU_STATE={self.sim_state}",
            "-e", f"LD_LIBRARY_PATH={CONTAINER_SIM_LIB}",
            "--rootfs", str(self.rootfs),
            program, *args,
        ]  # fmt: skip
        script = 'mkdir -p /var/run/cdi && mount --bind "$0" /var/run/cdi && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                str(self.cdi_root), *podman]  # fmt: skip

    def run(self, cdi_id: str, *args: str, program: str = "/bin/e2e_claim_quota") -> str:
        p = subprocess.run(self.command(cdi_id, *args, program=program), capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        assert p.returncode == 0, f"container {args} failed ({p.returncode}): {p.stderr[-2000:]}"
        return p.stdout

    def start(self, cdi_id: str, *args: str, program: str = "/bin/e2e_claim_quota"
              ) -> subprocess.Popen[str]:  # fmt: skip
        return subprocess.Popen(self.command(cdi_id, *args, program=program),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def value_of(out: str, key: str) -> int:
    for word in out.split():
        if word.startswith(f"{key}="):
            return int(word.split("=", 1)[1])
    raise AssertionError(f"no {key}= in {out!r}")


def wait_held(holder: subprocess.Popen[str], shared: Path) -> None:
    """Until the container's `hold` has its allocation (it creates `held` in /signal)."""
    deadline = time.monotonic() + 60
    while not (shared / "held").exists():
        if holder.poll() is not None:
            raise AssertionError(f"holder exited {holder.returncode}: {holder.stderr.read()}")  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "holder never allocated"
        time.sleep(0.1)


@pytest.fixture
def world(rootfs: Path) -> Iterator[tuple[FakeApiServer, KubeletStandin, Path, Podman]]:
    root = Path(tempfile.mkdtemp(prefix="vge", dir="/tmp"))
    sim_state = root / "simgpu-state"
    sim_state.mkdir()
    (root / "signal").mkdir()
    sim_env = dict(os.environ, SIMGPU_STATE=str(sim_state))
    sim_env.pop("SIMGPU_CONFIG", None)  # the simulator's default GPU
    with FakeApiServer() as server:
        if missing_cuda() is None:
            plugin = PluginProcess(root, server.url, simulator_env=sim_env)
        else:  # the simulator is not ready: plumbing tests still run, on made-up GPUs
            plugin = PluginProcess(root, server.url, fake_gpus())
        plugin.start()
        kubelet = KubeletStandin(root / "registry" / f"{DRIVER}-reg.sock")
        kubelet.register()
        try:
            yield server, kubelet, root, Podman(rootfs, root / "cdi", sim_state, root / "signal")
        finally:
            kubelet.close()
            plugin.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def bypass_in_rootfs(rootfs: Path, tmp_path: Path) -> Iterator[str]:
    program = compile_program(REPO / "tests" / "c" / "bypass_copy.c", tmp_path)
    dest = rootfs / "bin" / "bypass_copy"
    shutil.copy2(program, dest)
    # a new link-map namespace looks the loader up by name in the default directories
    loader = Path("/lib64/ld-linux-x86-64.so.2").resolve()
    extra = rootfs / "lib" / "x86_64-linux-gnu" / "ld-linux-x86-64.so.2"
    added = loader.exists() and not extra.exists()
    if added:
        extra.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(loader, extra)
    yield "/bin/bypass_copy"
    dest.unlink()
    if added:
        extra.unlink()

"""The DRA plugin (driver.driver.Driver) as its own process, for tests that kill and restart it.

    python -m tests.driver.plugin_process --root DIR --api URL --gpus GPUS.json|--simulator
        [--mode sharing|partition] [--partitions N] [--driver-root DIR]

DIR gets registry/ (registration socket), plugins/ (DRA socket), cdi/, data/ and dev/ (the
device-node root); the NVIDIA Container Toolkit's CDI specs are looked for in DIR/cdi-static/. Prints READY once serving; SIGTERM stops it cleanly. The environment
variable VGPU_TEST_CRASH_AT is honoured by the driver itself (driver/crashpoints.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import kubernetes.client

from driver import flags
from driver.claims import RulesFor
from driver.driver import Driver
from driver.flags import Settings
from driver.health import HealthBroadcaster
from driver.injection import DriverInjector, DriverRoot
from driver.reclaim import NvmlRead
from sharing.gpus import GpuInfo, list_gpus, use_simulator
from sharing.policy import load as load_policy

DRIVER = "vgpu.sharing.dev"
NODE = "node-a"


def settings_for(root: Path, driver_name: str = DRIVER, node: str = NODE) -> Settings:
    """The plugin's settings as its flags give them, with every path under `root`."""
    return flags.parse(
        [
            f"--node-name={node}",
            f"--driver-name={driver_name}",
            f"--cdi-root={root / 'cdi'}",
            f"--data-dir={root / 'data'}",
            f"--kubelet-registrar-directory-path={root / 'registry'}",
            f"--kubelet-plugins-directory-path={root / 'plugins'}",
        ],
        env={},
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--api", required=True)
    p.add_argument("--gpus", type=Path)
    p.add_argument("--simulator", action="store_true")
    p.add_argument("--mode", default="sharing")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--driver-root", type=Path, help="inject the driver's files from here")
    p.add_argument("--policy", type=Path, help="the admin's sharing policy (sharing/policy.py)")
    args = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.simulator:
        use_simulator()
        gpus = list_gpus()
    else:
        gpus = [GpuInfo(**g) for g in json.loads(args.gpus.read_text())]
    rules_for: RulesFor | None = None
    if args.policy is not None:
        policy = load_policy(args.policy)
        rules_for = lambda g: policy.for_gpu(g.name, {})  # noqa: E731
    cfg = kubernetes.client.Configuration()
    cfg.host = args.api
    driver = Driver(
        settings_for(args.root),
        kubernetes.client.ApiClient(cfg),
        gpus,
        args.mode,
        args.partitions,
        HealthBroadcaster(),
        dev_root=args.root / "dev",
        injector=DriverInjector(
            DriverRoot(args.driver_root, args.driver_root) if args.driver_root else None,
            [args.root / "cdi-static"],
            dev_root=args.root / "dev",
        ),
        rules_for=rules_for,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    driver.start()
    print("READY", flush=True)
    stop.wait()
    driver.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())


# --- harnesses for tests (imported, not run) ------------------------------------------------

H100 = dict(
    name="NVIDIA H100 80GB HBM3",
    memory_total=80 * 1024**3,
    memory_used=0,
    numa_node=0,
    compute_capability="9.0",
    driver_version="550.54.15",
    cuda_driver_version="12.4",
)


def fake_gpus(n: int = 2) -> list[GpuInfo]:
    return [
        GpuInfo(
            index=i,
            uuid=f"GPU-{i:08d}-0000-4000-8000-00000000000{i}",
            pci_bus_id=f"00000000:{0x10 + i:02X}:00.0",
            minor=i,
            **H100,  # type: ignore[arg-type]
        )
        for i in range(n)
    ]


class PluginProcess:
    """The plugin in a child process (tests that SIGKILL it)."""

    def __init__(self, root: Path, api: str, gpus: list[GpuInfo] | None = None,
                 simulator_env: dict[str, str] | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.extra_args = extra_args
        self.root = root
        self.api = api
        self.gpus_file = root / "gpus.json"
        if gpus is not None:
            self.gpus_file.write_text(json.dumps([g.to_dict() for g in gpus]))
        self.simulator_env = simulator_env
        self.proc: subprocess.Popen[str] | None = None
        self.log = root / "plugin.log"

    def start(self, crash_at: str | None = None, wait_ready: bool = True) -> None:
        env = dict(self.simulator_env or os.environ)
        env.pop("VGPU_TEST_CRASH_AT", None)
        if crash_at:
            env["VGPU_TEST_CRASH_AT"] = crash_at
        args = [sys.executable, "-m", "tests.driver.plugin_process", "--root", str(self.root),
                "--api", self.api]  # fmt: skip
        args += ["--simulator"] if self.simulator_env else ["--gpus", str(self.gpus_file)]
        args += self.extra_args
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                cwd=Path(__file__).resolve().parents[2],
            )  # fmt: skip
        if wait_ready:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if line.strip() != "READY":
                self.proc.kill()
                raise AssertionError(f"plugin did not start: {self.log.read_text()[-3000:]}")

    def wait_exit(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None


class InProcessPlugin:
    """The plugin in this process (most tests: faster, same sockets and gRPC)."""

    def __init__(self, root: Path, api_client: Any, gpus: list[GpuInfo] | None = None,
                 mode: str = "sharing", partitions: int = 4,
                 registration_backoff: tuple[float, float] = (1.0, 60.0),
                 rules_for: RulesFor | None = None,
                 nvml: NvmlRead | None = None) -> None:  # fmt: skip
        self.root = root
        self.settings = settings_for(root)
        self.health = HealthBroadcaster()
        self.driver = Driver(
            self.settings, api_client, gpus if gpus is not None else fake_gpus(), mode,
            partitions, self.health, dev_root=root / "dev",
            registration_backoff=registration_backoff, rules_for=rules_for, nvml=nvml,
        )  # fmt: skip

    @property
    def registration_socket(self) -> Path:
        return self.driver.plugin.sockets.registration

    def cdi_specs(self) -> list[Path]:
        d = self.settings.cdi_root
        return sorted(d.iterdir()) if d.exists() else []

    def claim_dirs(self) -> list[Path]:
        d = self.settings.data_dir / "claims"
        return sorted(d.iterdir()) if d.exists() else []

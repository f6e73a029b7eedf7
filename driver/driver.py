"""The kubelet side of the DRA driver: prepare/unprepare of claims, served to the kubelet.

Construction (by driver/main.py):

    driver = Driver(settings, api_client, gpus, mode, partitions, health)
    driver.start()   # installs the shim, recovers the checkpoint, serves the sockets
    ...
    driver.stop()    # removes the sockets (prepared claims stay: they outlive the plugin)

  settings    driver.flags.Settings
  api_client  a kubernetes.client.ApiClient (ResourceClaims are read through it)
  gpus        list[sharing.gpus.GpuInfo], this node's GPUs
  mode        "sharing" (device gpu-<i>, limits from consumedCapacity) or
              "partition" (devices gpu-<i>-slice-<k>, memory_total/N and 100/N cores)
  partitions  N, the slices per GPU in partition mode
  health      the HealthBroadcaster whose device list the health stream serves; when nobody has
              published yet, start() publishes every device of `gpus` as healthy

Files: under settings.data_dir (mode 0700: containers reach what they need through bind mounts,
which the runtime resolves as root; nobody else needs anything in it) as sharing/claimlayout.py
lays them out (the shim's copy and preload list, the checkpoint, one directory per claim, the
demand records), and CDI specs in settings.cdi_root: k8s.<driver>-claim_<uid>.json.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from driver import devicenames, hostfs
from driver.claimfiles import HostPaths
from driver.claims import RulesFor
from driver.claimstatus import ClaimStatusWriter
from driver.contextsize import ContextSizes
from driver.devicemetadata import published_attributes
from driver.events import ClaimEventPoster
from driver.flags import Settings
from driver.health import HealthBroadcaster
from driver.injection import DriverInjector
from driver.kube import Kube
from driver.kubelet import KubeletPlugin, PluginSockets
from driver.reclaim import NvmlRead
from driver.state import DeviceState
from sharing import claimlayout as layout
from sharing.fsutil import atomic_write
from sharing.gpus import GpuInfo
from sharing.paths import shim_library

log = logging.getLogger(__name__)


def install_shim(source: Path, lib_dir: Path) -> Path:
    """Copy the shim into lib_dir (atomically, only if changed) and write the preload list
    beside it naming its container path (sharing/claimlayout.py). Returns the installed library path.

    A copy, not the package's own path, because the CDI mount needs a stable host path that
    survives reinstalls, and replacing it by rename never changes a file a container has open.
    """
    lib_dir.mkdir(parents=True, exist_ok=True)
    target = lib_dir / layout.SHIM_LIBRARY
    data = source.read_bytes()
    if _current(target) != data:
        atomic_write(target, data, mode=0o755)
        log.info("installed shim %s -> %s", source, target)
    preload = lib_dir / layout.PRELOAD_FILE
    text = f"{layout.CONTAINER_LIB}\n".encode()
    if _current(preload) != text:
        atomic_write(preload, text, mode=0o644)
    return target


def _current(path: Path) -> bytes | None:
    """What an installed file holds; None when absent or not a regular file (a link is never
    followed: the rewrite replaces it)."""
    try:
        return hostfs.read_file(path)
    except OSError:
        return None


class Driver:
    def __init__(
        self,
        settings: Settings,
        api_client: Any,
        gpus: list[GpuInfo],
        mode: str,
        partitions: int,
        health: HealthBroadcaster,
        *,
        shim_source: Path | None = None,
        dev_root: Path = Path("/dev"),
        node_state_dir: Path | None = None,
        registration_backoff: tuple[float, float] = (1.0, 60.0),
        rules_for: RulesFor | None = None,
        injector: DriverInjector | None = None,
        after_probe: Callable[[], None] | None = None,
        nvml: NvmlRead | None = None,
    ) -> None:
        """shim_source (default sharing.paths.shim_library()), dev_root (where /dev/nvidia* are
        looked for) and node_state_dir (host directory of the compute controller's node-wide files,
        default <data dir>/node-state) exist for tests; main.py leaves them alone. rules_for: the
        admin sharing policy's rules per GPU (driver/policy.py; None: the built-in policy); injector:
        the driver's files for CDI-only runtimes (driver/injection.py; None: not injected);
        after_probe: called after each context-size helper ran (driver/contextsize.py); nvml: one
        fresh pass of the host's NVML, what a burst reclaim measures borrowers by besides their
        accounting files (driver/reclaim.py; None: the accounting files alone)."""
        if mode not in devicenames.MODES:
            raise ValueError(f"mode {mode!r} unknown; allowed: {', '.join(devicenames.MODES)}")
        if partitions < 1:
            raise ValueError(f"partitions {partitions} invalid; allowed: 1 or more")
        self.settings = settings
        self.gpus = list(gpus)
        self.mode = mode
        self.partitions = partitions
        self.health = health
        self._shim_source = shim_source
        data_dir = settings.data_dir
        self.paths = HostPaths(
            shim_library=data_dir / layout.LIB_DIR / layout.SHIM_LIBRARY,
            preload_file=data_dir / layout.LIB_DIR / layout.PRELOAD_FILE,
            claims_dir=data_dir / layout.CLAIMS_DIR,
            node_state_dir=node_state_dir or data_dir / layout.NODE_STATE_DIR,
            dev_root=dev_root,
        )
        self.claim_status = ClaimStatusWriter(api_client, settings.driver_name)
        self._kube = Kube(api_client)
        self.context_sizes = ContextSizes(data_dir, after_probe=after_probe)
        self.state = DeviceState(
            driver_name=settings.driver_name,
            node_name=settings.node_name,
            gpus=self.gpus,
            mode=mode,
            partitions=partitions,
            cdi_root=settings.cdi_root,
            checkpoint_path=data_dir / layout.CHECKPOINT_FILE,
            paths=self.paths,
            read=DeviceState.api_reader(api_client),
            rules_for=rules_for,
            injector=injector,
            context_sizes=self.context_sizes,
            on_prepared=self.claim_status.submit,
            on_unprepared=self.claim_status.submit_removal,
            published=self._published,
            on_event=ClaimEventPoster(
                api_client, settings.driver_name, settings.node_name
            ).for_claim,
            nvml=nvml,
        )
        self.plugin = KubeletPlugin(
            driver_name=settings.driver_name,
            sockets=PluginSockets.of(
                settings.kubelet_registrar_directory_path,
                settings.kubelet_plugins_directory_path,
                settings.driver_name,
            ),
            prepare=self.state.prepare,
            unprepare=self.state.unprepare,
            health=health,
            pool_name=settings.node_name,
            retry_backoff=registration_backoff,
        )

    def _published(self) -> dict[str, dict[str, Any]]:
        """This node's devices' attributes as its ResourceSlices on the server publish them."""
        s = self.settings
        slices = self._kube.list_slices(f"spec.nodeName={s.node_name},spec.driver={s.driver_name}")
        return published_attributes(slices)

    def start(self) -> None:
        """Raises CheckpointError (corrupt checkpoint) or ArtefactMissingError (no shim)."""
        s = self.settings
        source = self._shim_source or shim_library()
        install_shim(source, self.paths.shim_library.parent)
        s.cdi_root.mkdir(parents=True, exist_ok=True)
        os.chmod(s.data_dir, 0o700)  # the plugin's own; containers get bind mounts
        for d in (self.paths.claims_dir, self.paths.node_state_dir):
            d.mkdir(parents=True, exist_ok=True)
            # Only the plugin writes here, whatever mode the directory was left with: anyone else
            # who could create files in node-state could plant a claim's demand record.
            os.chmod(d, 0o755)
        self.state.recover()
        self.context_sizes.learn(self.gpus)  # in the background, before the first prepare needs it
        if not self.health.snapshot().devices:
            self.health.publish(
                {
                    name: ""  # healthy
                    for g in self.gpus
                    for name in devicenames.names(g.index, self.mode, self.partitions)
                }
            )
        self.plugin.start()
        log.info(
            "driver %s on node %s: %d GPUs, %s mode, CDI root %s",
            s.driver_name,
            s.node_name,
            len(self.gpus),
            self.mode,
            s.cdi_root,
        )

    def update_gpus(self, gpus: list[GpuInfo]) -> None:
        """Prepare claims on this set of GPUs from now on (called by rediscovery)."""
        self.gpus = list(gpus)
        self.state.set_gpus(gpus)
        self.context_sizes.learn(gpus)

    def stop(self) -> None:
        self.plugin.stop()
        self.claim_status.close()
        log.info("driver %s stopped", self.settings.driver_name)

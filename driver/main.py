"""`vgpu-kubelet-plugin`: the DRA kubelet plugin process.

Wiring: Settings -> kube ApiClient -> NVML discovery -> publishing mode (explicit, or probed
from the API server in auto) -> HealthBroadcaster -> Driver (gRPC sockets for the kubelet) ->
ResourceSlice publish loop and rediscovery loop, which feeds health/presence changes to both
the slices and the health stream. SIGTERM/SIGINT shut down cleanly (exit 0).

Exit codes: 0 clean shutdown; 1 startup failure (NVML, Kubernetes configuration, sockets);
2 bad flags or an invalid --policy file; 3 the API server's consumable-capacity support changed under a running plugin in
auto mode (restart to republish in the new mode; the DaemonSet does that).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from driver import hostfs, simulated
from driver.backoff import Backoff
from driver.checkpoint import CheckpointError
from driver.claim_pods import ClaimPods
from driver.devicenames import Mode, as_mode
from driver.discovery import Discovery, Inventory, NvmlBackend, PynvmlBackend, Rediscovery
from driver.driver import Driver
from driver.dryrun import dry_run
from driver.events import EventPoster
from driver.flags import Settings, SettingsError, parse
from driver.health import HealthBroadcaster
from driver.healthz import HealthServer, Status, socket_serves_grpc
from driver.injection import DriverInjector, DriverRoot, SimulatorInjector, load_driver_nvml
from driver.kube import Kube, KubeConfigError, make_api_client
from driver.policy import PolicyView, PolicyWatcher, initial_policy
from driver.publishloop import PublishLoop, describe_error
from driver.slicebuild import health_map
from driver.slicepublisher import SlicePublisher
from sharing import claimlayout, logsafe
from sharing.fsutil import atomic_write
from sharing.gpus import GpuInfo
from sharing.observe.exporter import Exporter, ExporterConfig
from sharing.observe.nvml_reader import read_nvml
from sharing.policy import PolicyError, SharingPolicy

log = logging.getLogger("driver.main")

EXIT_OK = 0
EXIT_STARTUP = 1
EXIT_USAGE = 2
EXIT_MODE_CHANGED = 3
CLEANUP_TIMEOUT = 10.0  # seconds of retrying the slice deletion at shutdown
# The inode of the initial PID namespace (PROC_PID_INIT_INO, linux/proc_ns.h), the same on
# every Linux host.
HOST_PID_NS_INODE = 0xEFFFFFFC


def in_host_pid_namespace(ns: str = "/proc/self/ns/pid") -> bool:
    """True when this process runs in the host's PID namespace (hostPID: true, or no container)."""
    try:
        return os.stat(ns).st_ino == HOST_PID_NS_INODE
    except OSError:
        return False


def evict_blind(policy: SharingPolicy, host_pid: bool) -> bool:
    """Whether `policy` lets a claim burst with reclaim `evict` on some GPU while the plugin is
    outside the host's PID namespace: it then finds none of a borrower's processes in /proc, so
    it can neither notice nor stop them (docs/policy.md, "Taking it back")."""
    if host_pid:
        return False
    rules = [policy.default, *(o.rules for o in policy.overrides)]
    return any(r.burst.allowed and r.burst.reclaim == "evict" for r in rules)


class StartupError(Exception):
    """The plugin cannot start. str() is one line."""


class Plugin:
    """One run of the plugin; run() blocks until stop() (or a signal) and returns the exit code."""

    def __init__(
        self,
        settings: Settings,
        *,
        backend: NvmlBackend | None = None,
        backoff: Backoff | None = None,
        resync: float = 30.0,
        reprobe: float = 300.0,
        sysfs_root: Path = Path("/sys"),
        policy: SharingPolicy | None = None,
    ) -> None:
        self.settings = settings
        self.policy = PolicyView(policy or initial_policy(None, settings.partitions))
        self.backend: NvmlBackend = backend or PynvmlBackend()
        self.backoff = backoff or Backoff()
        self.resync = resync
        self.reprobe = reprobe
        self.sysfs_root = sysfs_root
        self.stop_event = threading.Event()
        self.exit_code = EXIT_OK
        self.mode: Mode | None = None
        self.driver: Driver | None = None
        self.loop: PublishLoop | None = None
        self.healthz: HealthServer | None = None
        self._inventory: Inventory | None = None
        self.metrics: Exporter | None = None

    # -- mode --

    def _mode_file(self) -> Path:
        return self.settings.data_dir / claimlayout.MODE_FILE

    def _remembered_mode(self) -> Mode | None:
        try:
            text = hostfs.read_file(self._mode_file()).decode(errors="replace").strip()
        except OSError:
            return None
        return as_mode(text)

    def _remember_mode(self, mode: Mode) -> None:
        try:
            self.settings.data_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self._mode_file(), f"{mode}\n".encode())  # never through a link
        except OSError as e:
            log.warning("cannot record the publishing mode in %s: %s", self._mode_file(), e)

    def _initial_mode(self, publisher: SlicePublisher) -> Mode | None:
        """Explicit mode; else the one auto decided last time; else probe (retrying)."""
        requested = self.settings.sharing_mode
        if requested != "auto":
            return requested
        remembered = self._remembered_mode()
        if remembered is not None:
            log.info(
                "node %s: starting in %s mode (decided by an earlier run); re-checking with the "
                "API server",
                self.settings.node_name,
                remembered,
            )
            return remembered
        for delay in self.backoff.delays():
            try:
                return publisher.decide_mode()
            except Exception as e:
                log.warning(
                    "node %s: cannot ask the API server about consumable capacity (%s); "
                    "retrying in %gs",
                    self.settings.node_name,
                    describe_error(e),
                    delay,
                )
            if self.stop_event.wait(delay):
                return None
        return None  # pragma: no cover - delays() is endless

    def _on_mode(self, mode: Mode) -> None:
        if self.settings.sharing_mode != "auto":
            return
        if mode != self._remembered_mode():
            self._remember_mode(mode)
        if self.mode is not None and mode != self.mode:
            log.error(
                "node %s: the API server now wants %s mode but the plugin runs in %s mode; "
                "exiting to restart in %s mode",
                self.settings.node_name,
                mode,
                self.mode,
                mode,
            )
            self.exit_code = EXIT_MODE_CHANGED
            self.stop_event.set()

    # -- discovery -> slices + health stream --

    def _on_inventory(self, inv: Inventory) -> None:
        driver, loop, mode = self.driver, self.loop, self.mode
        if driver is None or loop is None or mode is None:
            return
        self._inventory = inv
        # The Driver must know a GPU before a claim on it can be prepared: hand it every change
        # of the set before the slices offer it.
        known = {(g.uuid, g.index) for g in driver.gpus}
        current = {(g.info.uuid, g.index) for g in inv.gpus}
        if current != known:
            for g in inv.gpus:
                if (g.info.uuid, g.index) not in known:
                    log.info(
                        "node %s: GPU %d (%s) appeared; offering it",
                        self.settings.node_name,
                        g.index,
                        g.info.uuid,
                    )
            driver.update_gpus([g.info for g in inv.gpus])
        loop.submit(inv)
        driver.health.publish(health_map(inv, mode, self.settings.partitions, self.policy.rules))

    def _check_burst_visibility(self, policy: SharingPolicy) -> None:
        if evict_blind(policy, in_host_pid_namespace()):
            log.warning(
                "node %s: the policy lets claims burst with reclaim evict, but the plugin is not "
                "in the host's PID namespace (hostPID: true): it cannot see a borrower's "
                "processes, to notify or stop them, so a prepare that needs borrowed memory fails "
                "until the borrower frees it by itself; run with hostPID, or reclaim: wait",
                self.settings.node_name,
            )

    def _on_policy(self, policy: SharingPolicy) -> None:
        """A new admin policy: republish now (partition counts may change device names)."""
        self._check_burst_visibility(policy)
        inv, loop, driver, mode = self._inventory, self.loop, self.driver, self.mode
        if loop is not None:
            loop.republish()
        if inv is not None and driver is not None and mode is not None:
            driver.health.publish(
                health_map(inv, mode, self.settings.partitions, self.policy.rules)
            )

    def _gpu_causes(self) -> dict[str, str]:
        """GPU UUID -> why it is unhealthy, for vgpu_device_healthy: the Inventory the slices'
        taints and the health stream come from (a MIG-enabled GPU is not unhealthy)."""
        inv = self._inventory
        if inv is None:
            return {}
        return {g.info.uuid: g.reason for g in inv.gpus if not g.healthy and not g.excluded}

    # -- liveness --

    def _health_status(self) -> Status:
        driver, loop = self.driver, self.loop
        if driver is None:
            # Alive while waiting for the API server or NVML at start-up: a restart would not
            # make a slow API server faster (readiness says the plugin is not serving yet).
            return Status(True, {"grpc": False, "reason": "starting"})
        sockets = driver.plugin.sockets
        reg_ok = socket_serves_grpc(sockets.registration)
        dra_ok = socket_serves_grpc(sockets.dra)
        return Status(
            reg_ok and dra_ok,
            {
                "grpc": {"registration": reg_ok, "dra": dra_ok},
                "registered": driver.plugin.registered.is_set(),
                "registrationAttempts": driver.plugin.registration_attempts,
                "apiServerReachable": loop.api_reachable if loop is not None else None,
                "mode": self.mode,
            },
        )

    def _ready_status(self) -> Status:
        """Ready: registered with the kubelet and this node's slices published."""
        driver, loop = self.driver, self.loop
        registered = driver is not None and driver.plugin.registered.is_set()
        published = loop is not None and loop.published_once
        return Status(
            registered and published,
            {
                "registered": registered,
                "slicesPublished": published,
                "mode": self.mode,
                "claimsWithoutShim": self._claims_without_shim(),
            },
        )

    def _claims_without_shim(self) -> list[dict[str, object]] | None:
        """The watchdog's last finding of claims' GPU processes running without the shim
        (None: no watchdog, --metrics-address is off). Reported, not a readiness failure: a
        tenant's image must not hold the plugin's DaemonSet rollout."""
        if self.metrics is None or not self.settings.watchdog:
            return None
        return [
            {
                "claim": f"{u.slice.namespace}/{u.slice.claim}",
                "claimUID": u.slice.claim_uid,
                "gpu": u.gpu_uuid,
                "pid": u.pid,
                "reason": u.why,
            }
            for u in self.metrics.watchdog.without_shim()
        ]

    # -- lifecycle --

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> int:
        """Start, serve until stop() (or a signal), shut down; the exit code."""
        publisher = self._start()
        if publisher is None:
            return self.exit_code
        try:
            self._serve(publisher)
        finally:
            self._shut_down(publisher)
        return self.exit_code

    def _start(self) -> SlicePublisher | None:
        """The health endpoint, NVML, the publishing mode, the Driver's sockets and the metrics;
        None after a failure (its one line logged, exit_code EXIT_STARTUP) or a stop while
        waiting for the API server, with whatever was started stopped again."""
        s = self.settings
        if s.healthcheck_port is not None:
            # Up before the first API call: a slow API server must not fail the probes.
            try:
                self.healthz = HealthServer(
                    s.healthcheck_port, self._health_status, ready=self._ready_status
                )
            except OSError as e:
                log.error("--healthcheck-port %d: cannot listen: %s", s.healthcheck_port, e)
                self.exit_code = EXIT_STARTUP
                return None
            self.healthz.start()
        try:
            self._check_sim_watchdog()
            self._check_burst_visibility(self.policy.policy)
            api_client = make_api_client(s.kubeconfig)
            injector = self._injector()
            gpus = self._list_gpus(injector)
            publisher = SlicePublisher(
                Kube(api_client),
                driver_name=s.driver_name,
                node_name=s.node_name,
                requested_mode=s.sharing_mode,
                partitions=s.partitions,
                reprobe_interval=self.reprobe,
                rules_for=self.policy.rules,
                on_node_labels=self.policy.set_node_labels,
            )
            mode = self._initial_mode(publisher)
            if mode is None:  # stopped while waiting for the API server
                self._stop_health()
                return None
            self.mode = mode
            publisher.use_mode(mode)
            if s.sharing_mode == "auto":
                self._remember_mode(mode)
            self.driver = Driver(
                s,
                api_client,
                gpus,
                mode,
                s.partitions,
                HealthBroadcaster(),
                rules_for=self.policy.rules,
                injector=injector,
                nvml=read_nvml,  # the ground truth of a burst reclaim (driver/reclaim.py)
            )
            self.driver.start()
            if s.metrics_address is not None:
                self._start_metrics(api_client)
            return publisher
        except (KubeConfigError, StartupError, CheckpointError) as e:  # one line each
            log.error("%s", e)
        except Exception as e:
            log.exception("node %s: startup failed: %s", s.node_name, describe_error(e))
        self._stop_driver()
        self._stop_health()
        self.exit_code = EXIT_STARTUP
        return None

    def _injector(self) -> DriverInjector:
        """What claims' containers get of the driver: --sim's simulated node (NVML points at it
        from here on), else NVIDIA's driver under the driver root (its NVML loaded from there)."""
        s = self.settings
        if s.sim:
            return SimulatorInjector(self._simulated_node())
        root = DriverRoot(s.driver_root, s.driver_root_mount)
        load_driver_nvml(root)
        return DriverInjector(root, s.cdi_spec_dirs)

    def _list_gpus(self, injector: DriverInjector) -> list[GpuInfo]:
        s = self.settings
        try:
            gpus = self.backend.list_gpus()
        except Exception as e:
            hint = (
                f"the simulator's line above says what is wrong with {injector.node.config}"
                + (f" (a copy of --sim-config {s.sim_config})" if s.sim_config else "")
                if isinstance(injector, SimulatorInjector)
                else "is the NVIDIA driver loaded and /dev/nvidia* visible to the plugin?"
            )
            raise StartupError(f"NVML: cannot list GPUs ({describe_error(e)}); {hint}") from e
        log.info(
            "node %s: %d GPU(s): %s",
            s.node_name,
            len(gpus),
            ", ".join(f"{g.index}={g.name} ({g.uuid})" for g in gpus) or "none",
        )
        return gpus

    def _serve(self, publisher: SlicePublisher) -> None:
        """Publish the slices, rediscover the GPUs and watch the policy until stop()."""
        s = self.settings
        self.loop = PublishLoop(
            publisher, backoff=self.backoff, resync=self.resync, on_mode=self._on_mode
        )
        rediscovery = Rediscovery(
            Discovery(self.backend, sysfs_root=self.sysfs_root),
            s.rediscover_interval,
            self._on_inventory,
        )
        threads = [threading.Thread(target=rediscovery.run, name="rediscovery", daemon=True)]
        watcher = None
        if s.policy is not None:
            watcher = PolicyWatcher(s.policy, self.policy, s.partitions, self._on_policy)
            threads.append(threading.Thread(target=watcher.run, name="policy", daemon=True))
        try:
            self.loop.start()
            for t in threads:
                t.start()
            while not self.stop_event.wait(1.0):
                pass  # a timed wait keeps the main thread responsive to signals
        finally:
            log.info("node %s: shutting down", s.node_name)
            rediscovery.stop_event.set()
            if watcher is not None:
                watcher.stop()
            for t in threads:
                t.join(5)

    def _shut_down(self, publisher: SlicePublisher) -> None:
        """After _serve: stop publishing (with --cleanup, withdraw the slices), then the Driver's
        sockets, the health endpoint and the metrics."""
        if self.loop is not None:
            self.loop.stop()
        if self.settings.cleanup:
            self._cleanup(publisher)
        if self.driver is not None:
            self.driver.stop()
            self.driver.health.close()
        self._stop_health()
        if self.metrics is not None:
            self.metrics.stop()

    def _check_sim_watchdog(self) -> None:
        """--sim with the watchdog: the simulated NVML names a claim's process by the PID the
        kernel gives it in the plugin's PID namespace, which is its host PID only when the plugin
        runs in the host's (hostPID: true). Elsewhere it falls back to the PID the process
        recorded in its own container, which may name another process here: the watchdog would
        blame, and with kill stop, the wrong one. So kill needs the host's PID namespace, and
        the watchdog alone is warned about."""
        s = self.settings
        if not (s.sim and s.watchdog) or in_host_pid_namespace():
            return
        if s.watchdog_enforce == "kill":
            raise StartupError(
                "--watchdog-enforce kill with --sim needs the host's PID namespace (hostPID: "
                "true on a node that is not itself a container): the simulated GPU names "
                "processes by their PID in this namespace; allowed here: --watchdog-enforce none"
            )
        log.warning(
            "node %s: the watchdog cannot attribute processes on the simulated GPU outside the "
            "host's PID namespace (it names them by their PIDs inside their containers, "
            "NVIDIA's driver by the host's); run with hostPID: true or --watchdog=false",
            s.node_name,
        )

    def _simulated_node(self) -> simulated.SimNode:
        """--sim: the simulated node under the data dir; NVML points at it from here on."""
        s = self.settings
        try:
            content = simulated.config_bytes(s.node_name, s.sim_gpus, s.sim_model, s.sim_config)
        except OSError as e:
            raise StartupError(f"--sim-config {s.sim_config}: cannot read it: {e}") from e
        try:
            node = simulated.install(
                s.data_dir / "sim", content, claims_dir=s.data_dir / claimlayout.CLAIMS_DIR
            )
        except OSError as e:
            raise StartupError(f"--sim: cannot lay out the simulated GPU: {e}") from e
        log.info(
            "node %s: simulated GPUs (%s), state %s",
            s.node_name,
            f"device file {s.sim_config}"
            if s.sim_config
            else f"{s.sim_gpus} x {simulated.SIM_MODELS[s.sim_model].name}",
            node.state_dir,
        )
        return node

    def _stop_health(self) -> None:
        if self.healthz is not None:
            self.healthz.stop()
            self.healthz = None

    def _start_metrics(self, api_client: object) -> None:
        """`vgpu exporter` + watchdog inside the plugin (--metrics-address)."""
        s = self.settings
        assert s.metrics_address is not None
        config = ExporterConfig(
            data_dir=s.data_dir,
            hostname=s.node_name,
            driver_name=s.driver_name,
            enforce=s.watchdog_enforce,
            watchdog=s.watchdog,
            # the kubelet's PodResources socket, beside its plugins directory
            pod_resources_socket=str(
                s.kubelet_plugins_directory_path.parent / "pod-resources" / "kubelet.sock"
            ),
        )
        events = EventPoster(api_client, s.driver_name, s.node_name)
        assert self.driver is not None
        ops = self.driver.plugin.ops  # the plugin's own requests, after the node's series
        ops.track_prepared(s.node_name, self.driver.state.prepared)
        ops.track_burst(self.driver.state.burst_reading)
        self.metrics = Exporter(
            config,
            events=events,
            pods=ClaimPods(api_client),
            device_health=self._gpu_causes,
            extra=ops.render,
        )
        host, port = s.metrics_address
        try:
            bound = self.metrics.start(host, port)
        except OSError as e:
            self.metrics = None
            raise StartupError(f"--metrics-address {host}:{port}: cannot listen: {e}") from e
        log.info("node %s: serving metrics on http://%s:%d/metrics", s.node_name, *bound)

    def _stop_driver(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self.driver is not None:
            self.driver.stop()
            self.driver.health.close()

    def _cleanup(self, publisher: SlicePublisher) -> None:
        delays = iter(self.backoff.delays())
        waited = 0.0
        while True:
            try:
                publisher.cleanup()
                return
            except Exception as e:
                delay = min(next(delays), CLEANUP_TIMEOUT - waited)
                if delay <= 0:
                    log.error(
                        "node %s: could not delete the ResourceSlices (%s); giving up",
                        self.settings.node_name,
                        describe_error(e),
                    )
                    return
                log.warning(
                    "node %s: deleting ResourceSlices failed (%s); retrying in %gs",
                    self.settings.node_name,
                    describe_error(e),
                    delay,
                )
                threading.Event().wait(delay)
                waited += delay


def _sim_dry_run(settings: Settings, policy: SharingPolicy, tmp: Path) -> int:
    """--dry-run --sim: the simulated node in a temporary directory (no data dir needed); an
    admin's --sim-config is read where it is, so the simulator's error names that file."""
    config = settings.sim_config
    if config is None:
        config = tmp / "config.json"
        config.write_bytes(
            simulated.config_bytes(settings.node_name, settings.sim_gpus, settings.sim_model, None)
        )
    (tmp / "state").mkdir(mode=0o700)
    simulated.point_nvml_at(config, tmp / "state")
    return dry_run(
        settings,
        PynvmlBackend(),
        rules_for=PolicyView(policy).rules,
        nvml_hint=f"the simulator's line above says what is wrong with {config}",
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse(sys.argv[1:] if argv is None else argv)
    except SettingsError as e:
        print(f"vgpu-kubelet-plugin: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        policy = initial_policy(settings.policy, settings.partitions)
    except PolicyError as e:
        print(f"vgpu-kubelet-plugin: error: --policy: {e}", file=sys.stderr)
        return EXIT_USAGE
    logsafe.configure(settings.log_level.upper(), sys.stderr)
    if settings.dry_run:
        if not settings.sim:
            return dry_run(settings, PynvmlBackend(), rules_for=PolicyView(policy).rules)
        with tempfile.TemporaryDirectory(prefix="vgpu-sim-") as d:
            return _sim_dry_run(settings, policy, Path(d))
    log.info("sharing policy: %s", policy.source)
    plugin = Plugin(settings, policy=policy)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(signum).name)
        plugin.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return plugin.run()


if __name__ == "__main__":
    sys.exit(main())

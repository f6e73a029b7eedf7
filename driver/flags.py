"""Command-line flags of `vgpu-kubelet-plugin`, each with an environment twin.

Precedence: the flag, then its environment variable, then the default. Every bad value is a
SettingsError whose str() is one line naming the flag, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from driver.devicenames import MODES, Mode
from driver.simulated import DEFAULT_SIM_MODEL, MAX_SIM_GPUS, SIM_MODELS
from sharing import claimlayout
from sharing.claimlayout import DEFAULT_DRIVER_NAME
from sharing.observe.exporter import DEFAULT_PORT, ListenError, parse_listen

SharingMode = Literal["auto", Mode]
SHARING_MODES: tuple[str, ...] = ("auto", *MODES)
MAX_PARTITIONS = 64  # 64 slices of one GPU is already under 1.3 GiB on an 80 GB card

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class SettingsError(ValueError):
    """A flag or environment value that is not acceptable. str() is one line."""


@dataclass(frozen=True)
class Settings:
    node_name: str
    kubeconfig: Path | None  # None: in-cluster configuration
    cdi_root: Path
    kubelet_registrar_directory_path: Path
    kubelet_plugins_directory_path: Path
    driver_name: str
    partitions: int
    healthcheck_port: int | None  # None: no HTTP health endpoint
    rediscover_interval: float  # seconds
    cleanup: bool
    data_dir: Path
    sharing_mode: SharingMode
    log_level: str
    dry_run: bool = False  # print the ResourceSlices and exit (no API server, no sockets)
    policy: Path | None = None  # the admin sharing policy file; None: the built-in default
    driver_root: Path = Path("/")  # the NVIDIA driver's root as the host sees it
    driver_root_mount: Path = Path("/")  # ... and as this process sees it
    cdi_spec_dirs: tuple[Path, ...] = (Path("/etc/cdi"), Path("/var/run/cdi"))
    metrics_address: tuple[str, int] | None = None  # None: no metrics endpoint
    watchdog_enforce: str = "none"  # none | kill (sharing/observe/watchdog.py)
    watchdog: bool = True  # the quota watchdog beside the metrics (needs hostPID)
    sim: bool = False  # the packaged simulated GPU instead of NVIDIA's driver
    sim_gpus: int = 1
    sim_model: str = DEFAULT_SIM_MODEL  # a key of driver.simulated.SIM_MODELS
    sim_config: Path | None = None  # a simulator device file instead of sim_gpus/sim_model

    @property
    def plugin_dir(self) -> Path:
        """Where the DRA socket lives: <plugins dir>/<driver name>/dra.sock."""
        return self.kubelet_plugins_directory_path / self.driver_name


@dataclass(frozen=True)
class _Flag:
    name: str  # without the leading dashes
    env: str
    help: str
    default: str | None
    is_bool: bool = False


_FLAGS: tuple[_Flag, ...] = (
    _Flag("node-name", "NODE_NAME", "name of this node (the pool name); required", None),
    _Flag(
        "kubeconfig", "KUBECONFIG", "kubeconfig file; in-cluster configuration when absent", None
    ),
    _Flag("cdi-root", "CDI_ROOT", "directory for the CDI spec files", "/var/run/cdi"),
    _Flag(
        "kubelet-registrar-directory-path",
        "KUBELET_REGISTRAR_DIRECTORY_PATH",
        "where the kubelet watches for plugin registration sockets",
        "/var/lib/kubelet/plugins_registry",
    ),
    _Flag(
        "kubelet-plugins-directory-path",
        "KUBELET_PLUGINS_DIRECTORY_PATH",
        "where the DRA socket directory <driver-name>/ is created",
        "/var/lib/kubelet/plugins",
    ),
    _Flag("driver-name", "DRIVER_NAME", "DRA driver name", DEFAULT_DRIVER_NAME),
    _Flag(
        "partitions",
        "PARTITIONS",
        "fixed slices per GPU in partition mode (1..64)",
        "4",
    ),
    _Flag(
        "healthcheck-port",
        "HEALTHCHECK_PORT",
        "HTTP port of /healthz (0: any free port; -1: disabled)",
        "-1",
    ),
    _Flag(
        "rediscover-interval",
        "REDISCOVER_INTERVAL",
        "how often GPUs are rediscovered (e.g. 30s, 1m, 500ms)",
        "30s",
    ),
    _Flag(
        "cleanup",
        "CLEANUP",
        "delete this node's ResourceSlices on clean shutdown",
        "false",
        is_bool=True,
    ),
    _Flag(
        "data-dir",
        "DATA_DIR",
        "directory for the driver's state (checkpoint)",
        claimlayout.DEFAULT_DATA_DIR,
    ),
    _Flag(
        "sharing-mode",
        "SHARING_MODE",
        "auto (sharing if the API server keeps consumable capacity, else partition), "
        "sharing or partition",
        "auto",
    ),
    _Flag("log-level", "LOG_LEVEL", "debug, info, warning or error", "info"),
    _Flag(
        "dry-run",
        "DRY_RUN",
        "print this node's ResourceSlices (YAML, as kubectl prints them) from NVML and exit; "
        "no API server needed (input for `vgpu plan`)",
        "false",
        is_bool=True,
    ),
    _Flag(
        "policy",
        "POLICY",
        "admin sharing policy file (YAML, docs/policy.md), re-read when it changes; "
        "the built-in default when absent",
        None,
    ),
    _Flag(
        "driver-root",
        "DRIVER_ROOT",
        "the NVIDIA driver's root on the host: / or /run/nvidia/driver (GPU Operator)",
        "/",
    ),
    _Flag(
        "driver-root-mount",
        "DRIVER_ROOT_MOUNT",
        "where the plugin sees the driver root (a read-only mount of it); default: the "
        "driver root itself",
        None,
    ),
    _Flag(
        "cdi-spec-dirs",
        "CDI_SPEC_DIRS",
        "comma-separated directories searched for the NVIDIA Container Toolkit's CDI spec",
        "/etc/cdi,/var/run/cdi",
    ),
    _Flag(
        "metrics-address",
        "METRICS_ADDRESS",
        "HOST:PORT to serve Prometheus metrics and run the quota watchdog on (docs/metrics.md; "
        f"a HOST alone means port {DEFAULT_PORT}); disabled when absent or empty",
        None,
    ),
    _Flag(
        "watchdog-enforce",
        "WATCHDOG_ENFORCE",
        "none (count, log and post an Event for a quota violation) or kill (also stop the "
        "offending processes)",
        "none",
    ),
    _Flag(
        "watchdog",
        "WATCHDOG",
        "run the quota watchdog with the metrics of --metrics-address (it reads other pods' "
        "processes: the plugin needs the host's PID namespace, hostPID); false: metrics only",
        "true",
        is_bool=True,
    ),
    _Flag(
        "sim",
        "SIM",
        "use the packaged simulated GPU instead of NVIDIA's driver (a cluster or node without "
        "GPUs; docs/simulator.md): the plugin's NVML and the driver injected into claims' "
        "containers are the simulator's",
        "false",
        is_bool=True,
    ),
    _Flag(
        "sim-gpus",
        "SIM_GPUS",
        f"with --sim: simulated GPUs on this node (1..{MAX_SIM_GPUS})",
        "1",
    ),
    _Flag(
        "sim-model",
        "SIM_MODEL",
        f"with --sim: model of the simulated GPUs ({', '.join(SIM_MODELS)})",
        DEFAULT_SIM_MODEL,
    ),
    _Flag(
        "sim-config",
        "SIM_CONFIG",
        "with --sim: a simulator device file (JSON, docs/simulator.md SIMGPU_CONFIG) instead "
        "of --sim-gpus and --sim-model",
        None,
    ),
)

_T = TypeVar("_T")


def _parse_bool(flag: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise SettingsError(f"--{flag}: {text!r} is not a boolean; allowed: true/false, 1/0, yes/no")


def _parse_int(flag: str, text: str, lo: int, hi: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise SettingsError(f"--{flag}: {text!r} is not an integer; allowed: {lo}..{hi}") from None
    if not lo <= value <= hi:
        raise SettingsError(f"--{flag}: {value} is out of range; allowed: {lo}..{hi}")
    return value


def parse_duration(flag: str, text: str) -> float:
    """'30s', '1m', '500ms', '1.5h' or plain seconds, as a positive number of seconds."""
    m = _DURATION.match(text.strip())
    if not m:
        raise SettingsError(
            f"--{flag}: {text!r} is not a duration; allowed: a number with ms, s, m or h "
            "(e.g. 30s, 500ms; plain numbers are seconds)"
        )
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if seconds <= 0:
        raise SettingsError(f"--{flag}: {text!r} must be longer than zero")
    return seconds


def _dns_subdomain(flag: str, text: str, max_len: int) -> str:
    if (
        not text
        or len(text) > max_len
        or not all(_DNS_LABEL.match(part) for part in text.split("."))
    ):
        raise SettingsError(
            f"--{flag}: {text!r} is not a valid name; allowed: a lowercase DNS subdomain of at "
            f"most {max_len} characters (a-z, 0-9, '-', '.')"
        )
    return text


def _choice(flag: str, text: str, allowed: Sequence[str]) -> str:
    low = text.strip().lower()
    if low not in allowed:
        raise SettingsError(f"--{flag}: {text!r} is not allowed; allowed: {', '.join(allowed)}")
    return low


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises SettingsError instead of printing usage and exiting."""

    def error(self, message: str) -> Any:  # argparse's signature is NoReturn-like
        raise SettingsError(message)


def _parser() -> _ArgumentParser:
    p = _ArgumentParser(
        prog="vgpu-kubelet-plugin",
        description="DRA kubelet plugin of vgpu-sharing: publishes this node's GPUs as "
        "ResourceSlices and prepares claims for containers. Every flag has an environment twin.",
        allow_abbrev=False,
    )
    for f in _FLAGS:
        dflt = f" (default {f.default})" if f.default is not None else ""
        if f.is_bool:
            p.add_argument(
                f"--{f.name}",
                nargs="?",
                const="true",
                default=None,
                metavar="BOOL",
                help=f"{f.help}{dflt}; env {f.env}",
            )
        else:
            p.add_argument(f"--{f.name}", default=None, help=f"{f.help}{dflt}; env {f.env}")
    return p


def usage() -> str:
    return _parser().format_help()


def parse(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Settings:
    """Settings from argv (without the program name) and the environment."""
    env = os.environ if env is None else env
    args = vars(_parser().parse_args(list(argv)))
    raw: dict[str, str | None] = {}
    for f in _FLAGS:
        value = args[f.name.replace("-", "_")]
        if value is None:
            value = env.get(f.env) or None
        raw[f.name] = value if value is not None else f.default

    def get(name: str, conv: Callable[[str, str], _T]) -> _T:
        text = raw[name]
        assert text is not None  # every caller's flag has a default
        return conv(name, text)

    node = raw["node-name"]
    if not node:
        raise SettingsError("--node-name (or NODE_NAME) is required: the name of this node")
    healthcheck = get("healthcheck-port", lambda n, t: _parse_int(n, t, -1, 65535))
    log_level = get("log-level", lambda n, t: _choice(n, t, ("debug", "info", "warning", "error")))
    kubeconfig = raw["kubeconfig"]
    policy = raw["policy"]
    driver_root = get("driver-root", _abs_path)
    sim = get("sim", _parse_bool)
    given = {f.name for f in _FLAGS if args[f.name.replace("-", "_")] or env.get(f.env)}
    for name in ("sim-gpus", "sim-model", "sim-config"):
        if name in given and not sim:
            raise SettingsError(f"--{name}: only with --sim (or SIM=true)")
    if "sim-config" in given and given & {"sim-gpus", "sim-model"}:
        raise SettingsError(
            "--sim-config: the device file names the GPUs; allowed: --sim-config alone, or "
            "--sim-gpus and --sim-model"
        )
    watchdog_enforce = get("watchdog-enforce", lambda n, t: _choice(n, t, ("none", "kill")))
    sim_config = raw["sim-config"]
    return Settings(
        node_name=_dns_subdomain("node-name", node, 253),
        kubeconfig=Path(kubeconfig) if kubeconfig else None,
        cdi_root=get("cdi-root", _abs_path),
        kubelet_registrar_directory_path=get("kubelet-registrar-directory-path", _abs_path),
        kubelet_plugins_directory_path=get("kubelet-plugins-directory-path", _abs_path),
        driver_name=get("driver-name", lambda n, t: _dns_subdomain(n, t, 63)),
        partitions=get("partitions", lambda n, t: _parse_int(n, t, 1, MAX_PARTITIONS)),
        healthcheck_port=None if healthcheck < 0 else healthcheck,
        rediscover_interval=get("rediscover-interval", parse_duration),
        cleanup=get("cleanup", _parse_bool),
        data_dir=get("data-dir", _abs_path),
        sharing_mode=cast(
            SharingMode, get("sharing-mode", lambda n, t: _choice(n, t, SHARING_MODES))
        ),
        log_level=log_level,
        dry_run=get("dry-run", _parse_bool),
        # A relative --policy is taken from the working directory (`--dry-run --policy
        # deploy/base/policy.yaml` from a checkout); it is watched by its absolute path.
        policy=Path(os.path.abspath(policy)) if policy else None,
        driver_root=driver_root,
        driver_root_mount=(
            _abs_path("driver-root-mount", raw["driver-root-mount"] or "")
            if raw["driver-root-mount"]
            else driver_root
        ),
        cdi_spec_dirs=tuple(
            _abs_path("cdi-spec-dirs", d.strip())
            for d in get("cdi-spec-dirs", lambda n, t: t).split(",")
            if d.strip()
        ),
        metrics_address=_metrics_address(raw["metrics-address"] or ""),
        watchdog_enforce=watchdog_enforce,
        watchdog=get("watchdog", _parse_bool),
        sim=sim,
        sim_gpus=get("sim-gpus", lambda n, t: _parse_int(n, t, 1, MAX_SIM_GPUS)),
        sim_model=get("sim-model", lambda n, t: _choice(n, t, tuple(SIM_MODELS))),
        sim_config=Path(sim_config).absolute() if sim_config else None,
    )


def _metrics_address(text: str) -> tuple[str, int] | None:
    """ "" -> None; else parse_listen's HOST:PORT, :PORT, [v6]:PORT, or HOST alone."""
    if not text:
        return None
    try:
        return parse_listen(text, default_port=DEFAULT_PORT)
    except ListenError as e:
        raise SettingsError(f"--metrics-address: {e}") from None


def _abs_path(flag: str, text: str) -> Path:
    if not text.startswith("/"):
        raise SettingsError(f"--{flag}: {text!r} must be an absolute path")
    return Path(text)

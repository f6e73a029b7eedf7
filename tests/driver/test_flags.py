"""Flags and their environment twins: defaults, precedence, one-line errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from driver.flags import SettingsError, parse, parse_duration, usage


def test_defaults() -> None:
    s = parse(["--node-name", "node-a"], env={})
    assert s.node_name == "node-a"
    assert s.kubeconfig is None
    assert s.cdi_root == Path("/var/run/cdi")
    assert s.kubelet_registrar_directory_path == Path("/var/lib/kubelet/plugins_registry")
    assert s.kubelet_plugins_directory_path == Path("/var/lib/kubelet/plugins")
    assert s.plugin_dir == Path("/var/lib/kubelet/plugins/vgpu.sharing.dev")
    assert s.driver_name == "vgpu.sharing.dev"
    assert s.partitions == 4
    assert s.healthcheck_port is None
    assert s.rediscover_interval == 30.0
    assert s.cleanup is False
    assert s.sharing_mode == "auto"
    assert s.data_dir == Path("/var/lib/vgpu-sharing")


def test_sim_flags_and_their_twins() -> None:
    s = parse(["--node-name", "n"], env={})
    assert (s.sim, s.sim_gpus, s.sim_model, s.sim_config, s.watchdog) == (
        False, 1, "h100-80gb", None, True,
    )  # fmt: skip
    s = parse([], env={"NODE_NAME": "n", "SIM": "true", "SIM_GPUS": "3", "SIM_MODEL": "T4",
                       "WATCHDOG": "false"})  # fmt: skip
    assert (s.sim, s.sim_gpus, s.sim_model, s.watchdog) == (True, 3, "t4", False)
    s = parse(["--node-name", "n", "--sim", "--sim-config", "dev.json"], env={})
    assert s.sim_config == Path.cwd() / "dev.json"  # relative: to the working directory


def test_env_twins_and_flag_precedence() -> None:
    env = {
        "NODE_NAME": "from-env",
        "KUBECONFIG": "/tmp/kc",
        "CDI_ROOT": "/run/cdi2",
        "KUBELET_REGISTRAR_DIRECTORY_PATH": "/r",
        "KUBELET_PLUGINS_DIRECTORY_PATH": "/p",
        "DRIVER_NAME": "gpu.example.com",
        "PARTITIONS": "8",
        "HEALTHCHECK_PORT": "8081",
        "REDISCOVER_INTERVAL": "1m",
        "CLEANUP": "true",
        "DATA_DIR": "/d",
        "SHARING_MODE": "partition",
        "LOG_LEVEL": "debug",
    }
    s = parse([], env=env)
    assert (s.node_name, s.kubeconfig, s.cdi_root) == (
        "from-env",
        Path("/tmp/kc"),
        Path("/run/cdi2"),
    )
    assert s.kubelet_registrar_directory_path == Path("/r")
    assert s.kubelet_plugins_directory_path == Path("/p")
    assert (s.driver_name, s.partitions, s.healthcheck_port) == ("gpu.example.com", 8, 8081)
    assert (s.rediscover_interval, s.cleanup, s.data_dir) == (60.0, True, Path("/d"))
    assert (s.sharing_mode, s.log_level) == ("partition", "debug")
    s = parse(
        ["--node-name=flag", "--partitions", "2", "--cleanup=false", "--sharing-mode", "SHARING"],
        env=env,
    )
    assert (s.node_name, s.partitions, s.cleanup, s.sharing_mode) == ("flag", 2, False, "sharing")
    assert parse(["--cleanup"], env={"NODE_NAME": "n"}).cleanup is True
    assert parse([], env={"NODE_NAME": "n", "HEALTHCHECK_PORT": "-1"}).healthcheck_port is None
    assert parse([], env={"NODE_NAME": "n", "HEALTHCHECK_PORT": "0"}).healthcheck_port == 0


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        ([], {}, "--node-name (or NODE_NAME) is required"),
        (["--node-name", "Node_A"], {}, "--node-name: 'Node_A' is not a valid name"),
        (
            ["--node-name", "n", "--partitions", "0"],
            {},
            "--partitions: 0 is out of range; allowed: 1..64",
        ),
        (["--node-name", "n"], {"PARTITIONS": "four"}, "--partitions: 'four' is not an integer"),
        (["--node-name", "n", "--healthcheck-port", "70000"], {}, "allowed: -1..65535"),
        (["--node-name", "n", "--rediscover-interval", "0s"], {}, "must be longer than zero"),
        (["--node-name", "n", "--rediscover-interval", "soon"], {}, "is not a duration"),
        (["--node-name", "n", "--sharing-mode", "mig"], {}, "allowed: auto, sharing, partition"),
        (["--node-name", "n", "--cleanup=maybe"], {}, "is not a boolean"),
        (["--node-name", "n", "--cdi-root", "relative/dir"], {}, "must be an absolute path"),
        (["--node-name", "n", "--driver-name", "UPPER.case"], {}, "--driver-name"),
        (["--node-name", "n", "--bogus"], {}, "unrecognized arguments: --bogus"),
        (["--node-name", "n", "--log-level", "loud"], {}, "allowed: debug, info, warning, error"),
        (["--node-name", "n", "--sim-gpus", "2"], {}, "--sim-gpus: only with --sim (or SIM=true)"),
        (["--node-name", "n"], {"SIM_MODEL": "l4"}, "--sim-model: only with --sim"),
        (["--node-name", "n", "--sim", "--sim-gpus", "0"], {}, "allowed: 1..64"),
        (["--node-name", "n", "--sim", "--sim-model", "x100"], {}, "allowed: h100-80gb, a100-80gb"),
        (
            ["--node-name", "n", "--sim", "--sim-config", "/c.json", "--sim-gpus", "2"],
            {},
            "--sim-config: the device file names the GPUs",
        ),
        (["--node-name", "n", "--watchdog=perhaps"], {}, "--watchdog: 'perhaps' is not a boolean"),
    ],
)
def test_errors_are_one_line_and_name_the_problem(
    argv: list[str], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(SettingsError) as e:
        parse(argv, env=env)
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg


def test_durations() -> None:
    assert parse_duration("x", "500ms") == 0.5
    assert parse_duration("x", "2") == 2.0
    assert parse_duration("x", "1.5h") == 5400.0


def test_usage_names_every_env_twin() -> None:
    text = usage()
    for env in ("NODE_NAME", "KUBECONFIG", "CDI_ROOT", "HEALTHCHECK_PORT", "SHARING_MODE"):
        assert env in text


def _help_flags() -> dict[str, tuple[str, str | None]]:
    """flag -> (env, default) as `vgpu-kubelet-plugin --help` prints them (unwrapped)."""
    exe = Path(sys.executable).with_name("vgpu-kubelet-plugin")
    out = subprocess.run(
        [str(exe), "--help"], env=dict(os.environ, COLUMNS="2000"), capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    blocks: list[str] = []
    for line in out.splitlines():
        if line.startswith("  --"):
            blocks.append(line)
        elif blocks and line.startswith("      "):
            blocks[-1] += " " + line.strip()
    rows: dict[str, tuple[str, str | None]] = {}
    for block in blocks:
        m = re.match(r"^\s+--([a-z-]+)(?: \S+)?\s+(.*); env (\w+)$", block)
        if m:
            d = re.search(r"\(default ([^)]*)\)", m.group(2))
            rows[m.group(1)] = (m.group(3), d.group(1) if d else None)
    return rows


def _doc_flags() -> dict[str, tuple[str, str | None]]:
    """flag -> (env, default) from the flag table of docs/driver.md; a default in prose (e.g.
    "(required)", "built-in default") is None, a literal (`30s`) is its text."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "driver.md").read_text()
    rows: dict[str, tuple[str, str | None]] = {}
    for line in text.splitlines():
        m = re.match(r"^\| `--([a-z-]+)` \| `(\w+)` \| ([^|]*) \|", line)
        if m:
            d = re.match(r"`([^`]*)`", m.group(3).strip())
            rows[m.group(1)] = (m.group(2), d.group(1) if d else None)
    return rows


@pytest.mark.slow
def test_documented_flags_match_help() -> None:
    """docs/driver.md lists every flag `--help` prints, with the same variable and default."""
    help_rows, doc_rows = _help_flags(), _doc_flags()
    assert len(help_rows) >= 20, help_rows
    assert doc_rows == help_rows


@pytest.mark.parametrize("host_pids", [True, False])
def test_sim_kill_needs_the_hosts_pid_namespace(
    host_pids: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--sim's NVML names processes by their host PID only to a plugin in the host's PID
    namespace (hostPID): elsewhere kill is refused at startup, and parsing accepts it."""
    from driver import main

    s = parse(["--node-name", "n", "--sim", "--watchdog-enforce", "kill"], env={})
    assert s.watchdog_enforce == "kill"
    monkeypatch.setattr(main, "in_host_pid_namespace", lambda: host_pids)
    plugin = main.Plugin(s)
    if host_pids:
        plugin._check_sim_watchdog()
    else:
        with pytest.raises(main.StartupError, match="needs the host's PID namespace"):
            plugin._check_sim_watchdog()


def test_the_host_pid_namespace_is_known_by_its_inode() -> None:
    from driver.main import HOST_PID_NS_INODE, in_host_pid_namespace

    ino = os.stat("/proc/self/ns/pid").st_ino
    assert in_host_pid_namespace() == (ino == HOST_PID_NS_INODE)
    assert not in_host_pid_namespace("/nonexistent")

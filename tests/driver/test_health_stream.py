"""The kubelet's health stream (DRAResourceHealth NodeWatchResources), v1 and v1alpha1, over
real gRPC on the plugin's unix socket: the complete device list in every message, the cause
in `message` (at most 1024 characters), a change sent at once, and the list re-sent while
nothing changes, each time freshly stamped, so the kubelet never times the devices out."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from driver.claims import ClaimRef
from driver.health import MAX_MESSAGE, HealthBroadcaster
from driver.kubelet import HEALTH_CHECK_TIMEOUT_SECONDS, KubeletPlugin, PluginSockets
from driver.state import PrepareResult
from tests.support.health_watcher import POOL, Watcher

VERSIONS = ("v1", "v1alpha1")


def _no_prepare(refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
    raise AssertionError("not called by these tests")


def _no_unprepare(refs: Sequence[ClaimRef]) -> dict[str, str]:
    raise AssertionError("not called by these tests")


@pytest.fixture
def plugin() -> Iterator[tuple[KubeletPlugin, HealthBroadcaster]]:
    root = Path(tempfile.mkdtemp(prefix="vgh", dir="/tmp"))  # short: unix socket paths
    health = HealthBroadcaster()
    p = KubeletPlugin(
        driver_name="vgpu.sharing.dev",
        sockets=PluginSockets.of(root / "registry", root / "plugins", "vgpu.sharing.dev"),
        prepare=_no_prepare,
        unprepare=_no_unprepare,
        health=health,
        pool_name=POOL,
        health_resend=0.2,
    )
    p.start()
    try:
        yield p, health
    finally:
        health.close()
        p.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_full_list_with_causes_at_start_on_change_and_resent(
    plugin: tuple[KubeletPlugin, HealthBroadcaster], version: str
) -> None:
    p, health = plugin
    health.publish({"gpu-0": "", "gpu-1": ""})
    w = Watcher(p.sockets.dra, version)
    try:
        first = w.next()
        assert w.view(first) == {"gpu-0": ("HEALTHY", ""), "gpu-1": ("HEALTHY", "")}
        assert {d.health_check_timeout_seconds for d in first.devices} == {
            HEALTH_CHECK_TIMEOUT_SECONDS
        }
        # Nothing changes: the same complete list comes again, stamped no earlier.
        again = w.next()
        assert w.view(again) == w.view(first)
        assert min(d.last_updated_time for d in again.devices) >= max(
            d.last_updated_time for d in first.devices
        )
        health.publish({"gpu-0": "", "gpu-1": "critical XID 79"})
        msg = w.next()
        while w.view(msg) == w.view(first):  # re-sends queued before the change
            msg = w.next()
        assert w.view(msg) == {
            "gpu-0": ("HEALTHY", ""),
            "gpu-1": ("UNHEALTHY", "critical XID 79"),
        }
        health.publish({"gpu-0": "", "gpu-1": ""})  # recovery
        msg = w.next()
        while w.view(msg)["gpu-1"][0] == "UNHEALTHY":
            msg = w.next()
        assert w.view(msg) == {"gpu-0": ("HEALTHY", ""), "gpu-1": ("HEALTHY", "")}
    finally:
        w.close()


def test_both_versions_serve_the_same_list_at_once(
    plugin: tuple[KubeletPlugin, HealthBroadcaster],
) -> None:
    p, health = plugin
    health.publish({"gpu-0": "GPU lost: NVML no longer reports it", "gpu-1": ""})
    watchers = [Watcher(p.sockets.dra, v) for v in VERSIONS]
    try:
        views = [w.view(w.next()) for w in watchers]
        assert (
            views[0]
            == views[1]
            == {
                "gpu-0": ("UNHEALTHY", "GPU lost: NVML no longer reports it"),
                "gpu-1": ("HEALTHY", ""),
            }
        )
    finally:
        for w in watchers:
            w.close()


def test_message_is_one_line_of_at_most_1024_characters(
    plugin: tuple[KubeletPlugin, HealthBroadcaster],
) -> None:
    p, health = plugin
    cause = "NVML unreachable: " + "driver said\nno " * 200
    health.publish({"gpu-0": cause})
    w = Watcher(p.sockets.dra, "v1")
    try:
        [dev] = w.next().devices
        assert len(dev.message) == MAX_MESSAGE
        assert dev.message.startswith("NVML unreachable: driver said no driver said")
        assert dev.message.endswith("...") and "\n" not in dev.message
    finally:
        w.close()

"""The plugin's live admin sharing policy (`--policy FILE`): the current policy, and a watcher
that applies valid edits without a restart.

A ConfigMap volume updates by a symlink swap (`..data -> ..<timestamp>/`, the key a link into
`..data`), so watching the file's inode would miss updates. The watcher re-reads the file by
path (following the links: the ConfigMap mount is the admin's, not a tenant's directory) every
`interval` seconds and compares the bytes. A valid change is applied and `on_change` called
(the plugin republishes its slices); an invalid one is logged as one line and the last good
policy stays; a vanished file keeps the last good policy too.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from sharing.gpus import GpuInfo
from sharing.policy import BUILTIN, PolicyError, Rules, SharingPolicy, load

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 2.0  # seconds between checks; well inside the 10 s republish promise


class PolicyView:
    """The policy in force and the Node's labels (for `nodeLabels` matches). Thread-safe."""

    def __init__(self, policy: SharingPolicy) -> None:
        self._lock = threading.Lock()
        self._policy = policy
        self._labels: dict[str, str] = {}

    @property
    def policy(self) -> SharingPolicy:
        with self._lock:
            return self._policy

    def set_policy(self, policy: SharingPolicy) -> None:
        with self._lock:
            self._policy = policy

    def set_node_labels(self, labels: Mapping[str, str]) -> None:
        with self._lock:
            self._labels = dict(labels)

    def rules(self, gpu: GpuInfo) -> Rules:
        with self._lock:
            return self._policy.for_gpu(gpu.name, self._labels)


def initial_policy(path: Path | None, partitions: int) -> SharingPolicy:
    """The start-up policy: the file's, or the built-in default. Raises PolicyError. Each
    deprecated field the file uses is logged as one line saying how it is read."""
    policy = _read(path, partitions)
    _log_deprecations(policy)
    return policy


def _read(path: Path | None, partitions: int) -> SharingPolicy:
    base = replace(BUILTIN, partitions=partitions)
    if path is None:
        return SharingPolicy(default=base)
    return load(path, base)


def _log_deprecations(policy: SharingPolicy) -> None:
    for note in policy.deprecations:
        log.warning("policy %s: %s", policy.source, note)


def _digest(path: Path) -> bytes | None:
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None


class PolicyWatcher:
    """Polls the policy file; run() until stop()."""

    def __init__(
        self,
        path: Path,
        view: PolicyView,
        partitions: int,
        on_change: Callable[[SharingPolicy], None],
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        self.path = path
        self.view = view
        self.partitions = partitions
        self.on_change = on_change
        self.interval = interval
        self.stop_event = threading.Event()
        # Unknown at first: the file may have changed since the start-up policy was read; the
        # first check compares what it parses with the policy in force.
        self._seen: bytes | None = None
        self._missing_logged = False

    def check(self) -> bool:
        """Look once; True if a new policy was applied."""
        digest = _digest(self.path)
        if digest is None:
            if not self._missing_logged:
                self._missing_logged = True
                log.warning(
                    "policy %s: cannot read the file; keeping the policy in force", self.path
                )
            return False
        self._missing_logged = False
        if digest == self._seen:
            return False
        self._seen = digest
        try:
            policy = _read(self.path, self.partitions)
        except PolicyError as e:
            log.error("policy not applied, keeping the last good one: %s", e)
            return False
        if policy == self.view.policy:
            return False
        self.view.set_policy(policy)
        log.info(
            "policy %s applied: %d override(s); republishing ResourceSlices",
            self.path,
            len(policy.overrides),
        )
        _log_deprecations(policy)
        self.on_change(policy)
        return True

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            try:
                self.check()
            except Exception:  # never let a watcher bug take the plugin down
                log.exception("policy %s: check failed", self.path)

    def stop(self) -> None:
        self.stop_event.set()

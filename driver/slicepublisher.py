"""Writing this node's pool of ResourceSlices (resource.k8s.io/v1) to the API server.

The pool (pool name = node name) is owned by the Node, so it goes with it. Each publish brings
the pool in line with the latest Inventory: unchanged slices are left alone (by content and
resourceVersion), changed ones are replaced under a new pool generation, and leftovers are
deleted only after the new generation is complete. The content comes from driver/slicebuild.py,
the mode from driver/sliceprobe.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from driver.devicenames import Mode
from driver.discovery import Inventory
from driver.kube import ApiException, Kube
from driver.slicebuild import (
    RulesFor,
    build_devices,
    builtin_rules,
    chunk,
    slice_body,
    slice_name,
    taint_key,
    too_small,
    too_small_message,
)
from driver.sliceprobe import ModeProbe

log = logging.getLogger(__name__)


@dataclass
class _Written:
    name: str
    resource_version: str
    devices: list[dict[str, Any]]


class SlicePublisher:
    """Writes the pool of this node; not thread-safe (PublishLoop serialises the calls)."""

    def __init__(
        self,
        kube: Kube,
        *,
        driver_name: str,
        node_name: str,
        requested_mode: str,  # auto | sharing | partition
        partitions: int,
        reprobe_interval: float = 300.0,
        rules_for: RulesFor | None = None,
        on_node_labels: Callable[[dict[str, str]], None] | None = None,
    ) -> None:
        """rules_for: the admin policy's rules per GPU (default: built-in with `partitions`);
        on_node_labels: told the Node's labels before every publish (policy nodeLabels match)."""
        self.kube = kube
        self.rules_for = rules_for
        self.on_node_labels = on_node_labels
        self.driver_name = driver_name
        self.node_name = node_name
        self.requested_mode = requested_mode
        self.partitions = partitions
        self.probe_ = ModeProbe(
            kube,
            driver_name=driver_name,
            node_name=node_name,
            requested_mode=requested_mode,
            partitions=partitions,
            reprobe_interval=reprobe_interval,
        )
        self.generation = 0
        self._written: dict[str, _Written] = {}
        self._small_warned: set[tuple[Any, ...]] = set()

    @property
    def mode(self) -> Mode | None:
        """The mode the slices are published in, once decided; fixed for the publisher's life."""
        return self.probe_.mode

    @property
    def server_mode(self) -> Mode | None:
        """auto: what the API server supports by the latest probe (None before the first).

        It can differ from `mode` after a cluster upgrade or downgrade; the owner decides what to
        do (the plugin restarts, since the kubelet side reads claims by mode)."""
        return self.probe_.server_mode

    def use_mode(self, mode: Mode) -> None:
        """Publish in this mode (decided elsewhere, e.g. remembered from an earlier run)."""
        self.probe_.mode = mode

    def _slice_name(self, k: int) -> str:
        return slice_name(self.node_name, self.driver_name, k)

    def _read_node(self) -> dict[str, Any] | None:
        """The Node (None if it does not exist); its labels go to on_node_labels."""
        try:
            node = self.kube.read_node(self.node_name)
        except ApiException as e:
            if e.status != 404:
                raise
            return None
        if self.on_node_labels is not None:
            self.on_node_labels(dict((node.get("metadata") or {}).get("labels") or {}))
        return node

    def _owner(self, node: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The Node as owner. Read at every publish: a Node deleted and re-created has a new
        UID, and slices owned by the old one would be garbage-collected."""
        if node is None:
            log.warning(
                "node %s: Node object not found; publishing ResourceSlices without an owner "
                "reference (they will not be garbage-collected with the Node)",
                self.node_name,
            )
            return []
        uid = str(node["metadata"]["uid"])
        return [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self.node_name,
                "uid": uid,
                "controller": True,
            }
        ]

    def _existing(self) -> dict[str, dict[str, Any]]:
        """Our pool's slices on the server, by name, as JSON dicts."""
        items = self.kube.list_slices(
            f"spec.nodeName={self.node_name},spec.driver={self.driver_name}"
        )
        out: dict[str, dict[str, Any]] = {}
        for d in items:
            if ((d.get("spec") or {}).get("pool") or {}).get("name") == self.node_name:
                out[d["metadata"]["name"]] = d
        return out

    def probe(self) -> Mode:
        """Ask the API server which mode it supports now (driver/sliceprobe.py)."""
        return self.probe_.probe()

    def decide_mode(self) -> Mode:
        """The mode to publish in: explicit, set by use_mode(), or probed once (auto)."""
        return self.probe_.decide()

    def publish(self, inv: Inventory) -> bool:
        """Bring the pool in line with inv; True if anything was written. Raises on API errors.

        In auto mode the server is probed again every `reprobe_interval` (see server_mode);
        the publishing mode itself does not change.
        """
        mode = self.probe_.for_publish()
        taints = self.probe_.taints
        wrote = self._publish(inv, mode, bool(taints))
        if taints and not self.probe_.taints:
            # The server dropped the taints just written: leave the unhealthy GPUs out now.
            self._publish(inv, mode, False)
        return wrote

    def _publish(self, inv: Inventory, mode: Mode, taints: bool) -> bool:
        """Unhealthy GPUs tainted (taints) or left out."""
        node = self._read_node() if self.rules_for is not None else None
        self._warn_too_small(inv, mode)
        key = taint_key(self.driver_name) if taints else None
        devices = build_devices(inv.gpus, mode, self.partitions, self.rules_for, key)
        chunks = chunk(devices)
        names = [self._slice_name(k) for k in range(len(chunks))]
        existing = self._existing()
        unchanged = (
            self.generation > 0
            and set(existing) == set(names)
            and all(
                n in self._written
                and self._written[n].devices == c
                and existing[n]["metadata"].get("resourceVersion")
                == self._written[n].resource_version
                for n, c in zip(names, chunks, strict=True)
            )
        )
        if unchanged:
            return False
        generation = (
            max(
                [self.generation]
                + [
                    int(((e.get("spec") or {}).get("pool") or {}).get("generation", 0))
                    for e in existing.values()
                ]
            )
            + 1
        )
        owner = self._owner(node if self.rules_for is not None else self._read_node())
        written: dict[str, _Written] = {}
        for name, devs in zip(names, chunks, strict=True):
            body = slice_body(
                name, self.driver_name, self.node_name, devs, generation, len(chunks), owner
            )
            if name in existing:
                body["metadata"]["resourceVersion"] = existing[name]["metadata"]["resourceVersion"]
                resp = self.kube.replace_slice(name, body)
            else:
                resp = self.kube.create_slice(body)
            written[name] = _Written(name, str(resp["metadata"]["resourceVersion"]), devs)
            self.probe_.note_stored(name, devs, resp)
        # Leftovers go after the new generation is complete, so the pool is never short.
        for name in sorted(set(existing) - set(names)):
            self.kube.delete_slice(name)
        self._written = written
        self.generation = generation
        log.info(
            "node %s: published %d device(s) in %d ResourceSlice(s), %s mode, pool generation %d",
            self.node_name,
            len(devices),
            len(chunks),
            mode,
            generation,
        )
        return True

    def _warn_too_small(self, inv: Inventory, mode: Mode) -> None:
        rules_of = self.rules_for or builtin_rules(self.partitions)
        warned = self._small_warned
        for g in inv.gpus:
            rules = rules_of(g.info)
            key = (g.info.uuid, rules.reserved_memory, rules.memory, rules.partitions)
            if too_small(g.info, mode, rules) and key not in warned:
                warned.add(key)
                log.warning("%s", too_small_message(self.node_name, g.index, g.info, rules))

    def forget_warnings(self) -> None:
        """Warn again about GPUs the policy leaves nothing to offer (a reloaded policy)."""
        self._small_warned = set()

    def cleanup(self) -> int:
        """Delete every slice of this node's pool; the number deleted."""
        n = 0
        for name in sorted(self._existing()):
            n += self.kube.delete_slice(name)
        self._written = {}
        log.info("node %s: deleted %d ResourceSlice(s)", self.node_name, n)
        return n

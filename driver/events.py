"""Kubernetes Events for the quota watchdog (sharing/observe/watchdog.py): one Event per violation,
on the ResourceClaim it concerns (or on the Node for a GPU process of no claim).

Posting happens in a short-lived thread with a request timeout: a slow API server never holds
the NVML poller the watchdog runs in. A failure is logged, never raised.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import uuid
from typing import Any, cast

import kubernetes

from sharing.observe.slices import Slice

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 5.0  # seconds per Event POST
COMPONENT = "vgpu-sharing-watchdog"


class EventPoster:
    def __init__(self, api_client: Any, driver_name: str, node_name: str) -> None:
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.driver_name = driver_name
        self.node_name = node_name

    def body(self, s: Slice | None, reason: str, message: str) -> dict[str, Any]:
        if s is not None and s.claim_uid and s.namespace and s.claim:
            ns = s.namespace
            obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                   "namespace": ns, "name": s.claim, "uid": s.claim_uid}  # fmt: skip
        else:
            ns = "default"
            obj = {"apiVersion": "v1", "kind": "Node", "name": self.node_name}
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{obj['name']}.{uuid.uuid4().hex[:16]}", "namespace": ns},
            "involvedObject": obj,
            "reason": reason,
            "message": message[:1024],
            "type": "Warning",
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": f"{self.driver_name}/{COMPONENT}",
            "reportingInstance": f"{self.node_name}-{os.getpid()}",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }

    def __call__(self, s: Slice | None, reason: str, message: str) -> None:
        body = self.body(s, reason, message)
        threading.Thread(
            target=self._post, args=(body,), name="watchdog-event", daemon=True
        ).start()

    def _post(self, body: dict[str, Any]) -> None:
        ns = body["metadata"]["namespace"]
        try:
            self.core.create_namespaced_event(ns, cast(Any, body), _request_timeout=REQUEST_TIMEOUT)
        except Exception as e:
            log.warning("watchdog: cannot post Event %s in %s: %s", body["reason"], ns, e)


BURST_COMPONENT = "vgpu-sharing-burst"


class ClaimEventPoster(EventPoster):
    """Events of the burst reclaim (docs/policy.md): on a ResourceClaim named by its namespace,
    name and UID, posted in a short-lived thread like the watchdog's."""

    def for_claim(self, namespace: str, name: str, uid: str, reason: str, message: str) -> None:
        body = self.body(None, reason, message)
        body["metadata"] = {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": namespace}
        body["involvedObject"] = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                  "namespace": namespace, "name": name, "uid": uid}  # fmt: skip
        body["source"] = {"component": BURST_COMPONENT, "host": self.node_name}
        body["reportingComponent"] = f"{self.driver_name}/{BURST_COMPONENT}"
        threading.Thread(target=self._post, args=(body,), name="burst-event", daemon=True).start()

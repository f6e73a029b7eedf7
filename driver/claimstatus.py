"""The claim's device status (ResourceClaim `status.devices`), written after prepare.

One entry per allocated device of ours: driver, pool, device and shareID (the entry's key), a
`Ready` condition, and `data` an operator reads with `kubectl get resourceclaim -o yaml`: the
enforced memory limit (bytes and Kubernetes form), the SM cap in percent, the compute policy and
priority, and the GPU's UUID and index.

How it is written: server-side apply of `status.devices` alone on the `status` subresource, field
manager = the driver name, so the entries of other drivers and the scheduler's allocation are
never touched and no read-modify-write can race them. The API server (1.36+, granular status
authorization) checks `resourceclaims/driver` with the verb `associated-node:patch` for the
plugin's service account on the claim's node (deploy/base/rbac.yaml).

Only on servers 1.36 and newer (probed once, GET /version): older ones authorise status writes
with `resourceclaims/status` alone, which would let a node's plugin rewrite any claim's status.
A server that refuses (404: no status subresource, 403: the RBAC rule missing, 415: no apply)
gets one log line and no further attempt; a failure of one claim is one warning line. Writing
happens in one background thread: prepare never waits for the API server here.

At unprepare the same field manager applies an empty `status.devices`: server-side apply then
removes the entries this manager owned (and only those; other drivers' stay). That apply names
the claim's UID, so a claim deleted and created again under the same name is never touched; a
claim already deleted is nothing to do.
"""

from __future__ import annotations

import datetime
import json
import logging
import queue
import re
import threading
from dataclasses import dataclass
from typing import Any

import kubernetes

from driver.claims import AllocatedDevice, ClaimPlan, ClaimRef
from sharing.kubequantity import to_kubernetes

log = logging.getLogger(__name__)

MIN_VERSION = (1, 36)  # granular status authorization (resourceclaims/driver)
REQUEST_TIMEOUT = 10.0
APPLY = "application/apply-patch+yaml"
_DISABLING = {403, 404, 405, 415}  # the server cannot or will not take it: stop trying


def device_entry(d: AllocatedDevice, driver_name: str, now: str) -> dict[str, Any]:
    """One `status.devices` entry for an allocated device of ours."""
    entry: dict[str, Any] = {"driver": driver_name, "pool": d.pool, "device": d.device}
    if d.share_id:
        entry["shareID"] = d.share_id
    entry["conditions"] = [
        {
            "type": "Ready",
            "status": "True",
            "reason": "Prepared",
            "message": (
                f"limits enforced on GPU {d.gpu.index}: memory {to_kubernetes(d.memory_limit)}, "
                f"SM {d.sm_limit}%, compute policy {d.config.compute_policy}"
            ),
            "lastTransitionTime": now,
        }
    ]
    entry["data"] = {
        "memoryLimitBytes": d.memory_limit,
        "memoryLimit": to_kubernetes(d.memory_limit),
        "smLimitPercent": d.sm_limit,
        "computePolicy": d.config.compute_policy,
        "priority": d.config.priority,
        "gpuUUID": d.gpu.uuid,
        "gpuIndex": d.gpu.index,
    }
    return entry


def status_patch(plan: ClaimPlan, driver_name: str, now: str | None = None) -> dict[str, Any]:
    """The apply configuration: the claim's identity and our entries of `status.devices`."""
    if now is None:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": plan.ref.name, "namespace": plan.ref.namespace},
        "status": {"devices": [device_entry(d, driver_name, now) for d in plan.devices]},
    }


def parse_version(doc: dict[str, Any]) -> tuple[int, int] | None:
    """(major, minor) of a /version answer ("1", "36+" or gitVersion "v1.36.2"); None if unclear."""
    major, minor = str(doc.get("major", "")), str(doc.get("minor", ""))
    m1, m2 = re.match(r"\d+", major), re.match(r"\d+", minor)
    if m1 and m2:
        return int(m1.group()), int(m2.group())
    m = re.match(r"v(\d+)\.(\d+)", str(doc.get("gitVersion", "")))
    return (int(m.group(1)), int(m.group(2))) if m else None


def removal_patch(ref: ClaimRef) -> dict[str, Any]:
    """The apply configuration that gives up every `status.devices` entry of the claim."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
        "status": {"devices": []},
    }


@dataclass
class _Job:
    plan: ClaimPlan | None = None  # write this claim's entries
    removed: ClaimRef | None = None  # remove this claim's entries
    # neither: the writer is closing

    @property
    def ref(self) -> ClaimRef | None:
        return self.plan.ref if self.plan is not None else self.removed


class ClaimStatusWriter:
    """Writes the device status of prepared claims, in the background (see the module doc)."""

    def __init__(self, api_client: Any, driver_name: str) -> None:
        self.api_client = api_client
        self.driver_name = driver_name
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._enabled: bool | None = None  # None: not probed yet
        self._closed = False
        self.written = 0  # claims whose status the server took (tests, logs)
        self.removed = 0  # unprepared claims whose entries the server removed

    def submit(self, plan: ClaimPlan) -> None:
        self._put(_Job(plan=plan))

    def submit_removal(self, ref: ClaimRef) -> None:
        """Remove this driver's entries of an unprepared claim."""
        self._put(_Job(removed=ref))

    def _put(self, job: _Job) -> None:
        if self._enabled is False:
            return
        with self._start_lock:
            if self._closed:
                return
            self._queue.put(job)
            if self._thread is None:
                # Not a daemon: close() ends it, so it never logs while the interpreter exits.
                self._thread = threading.Thread(target=self._run, name="claim-status")
                self._thread.start()

    def close(self) -> None:
        """Finish the write under way (bounded by the request timeout), drop the rest, and end
        the thread. Called when the plugin stops."""
        with self._start_lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        while True:  # what is still queued is not written: the plugin is going away
            try:
                self._queue.get_nowait()
                self._queue.task_done()
            except queue.Empty:
                break
        self._queue.put(_Job())
        thread.join(timeout=3 * REQUEST_TIMEOUT)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job.ref is None:
                self._queue.task_done()
                return
            try:
                if self._enabled is None:
                    self._enabled = self._probe()
                if self._enabled and job.plan is not None:
                    self._write(job.plan)
                elif self._enabled and job.removed is not None:
                    self._remove(job.removed)
            except Exception:
                log.exception("claim %s: writing its device status failed", job.ref)
            finally:
                self._queue.task_done()

    def idle(self) -> None:
        """Block until every submitted claim is handled (tests)."""
        self._queue.join()

    def _probe(self) -> bool | None:
        """True: write; False: this server never takes it; None: unknown yet (unreachable)."""
        try:
            resp: Any = kubernetes.client.VersionApi(self.api_client).get_code(
                _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
            version = parse_version(json.loads(resp.data))
        except Exception as e:  # unreachable now: try again with the next claim
            log.warning("claim device status: cannot read the API server's version: %s", e)
            return None
        if version is None or version < MIN_VERSION:
            shown = ".".join(map(str, version)) if version else "unknown"
            log.info(
                "claim device status not written: the API server is %s; it is written on 1.36+ "
                "(granular status authorization, resourceclaims/driver)",
                shown,
            )
            return False
        return True

    def _write(self, plan: ClaimPlan) -> None:
        if self._apply(plan.ref, status_patch(plan, self.driver_name)):
            self.written += 1
            log.debug("claim %s: device status written", plan.ref)

    def _remove(self, ref: ClaimRef) -> None:
        if self._apply(ref, removal_patch(ref), gone_ok=True):
            self.removed += 1
            log.debug("claim %s: device status removed", ref)

    def _apply(self, ref: ClaimRef, body: dict[str, Any], gone_ok: bool = False) -> bool:
        """One apply of the claim's status; True when the server took it. gone_ok: a claim
        that no longer exists (404 naming it, 409: another claim of that name) is fine."""
        api = kubernetes.client.ResourceV1Api(self.api_client)
        try:
            api.patch_namespaced_resource_claim_status(
                ref.name,
                ref.namespace,
                body,
                field_manager=self.driver_name,
                force=True,
                _content_type=APPLY,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except kubernetes.client.ApiException as e:
            if gone_ok and (e.status == 409 or (e.status == 404 and _names_the_claim(e))):
                log.debug("claim %s: gone, no device status to remove", ref)
                return False
            if e.status in _DISABLING:
                self._enabled = False
                log.warning(
                    "claim device status: the API server refused it (HTTP %s %s); not writing "
                    "it any more (RBAC: resourceclaims/status patch and resourceclaims/driver "
                    "associated-node:patch, deploy/base/rbac.yaml)",
                    e.status,
                    e.reason,
                )
                return False
            log.warning("claim %s: device status not written: HTTP %s %s", ref, e.status,
                        _message(e))  # fmt: skip
            return False
        except Exception as e:
            log.warning("claim %s: device status not written: %s", ref, e)
            return False
        return True


def _names_the_claim(e: Any) -> bool:
    """A 404 about the claim itself (a NotFound status naming resourceclaims), not a server
    without the status subresource."""
    try:
        details = json.loads(e.body).get("details") or {}
    except Exception:
        return False
    return bool(details.get("name")) and details.get("kind") == "resourceclaims"


def _message(e: Any) -> str:
    try:
        return str(json.loads(e.body).get("message", e.reason))
    except Exception:
        return str(e.reason)

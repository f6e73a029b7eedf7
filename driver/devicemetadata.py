"""The device metadata files of a claim (Kubernetes' DRA device metadata, KEP-5304): what the
container reads to learn its devices and its quota without the API.

Protocol (kubernetes.io, "DRA device metadata"; the kubelet plugin library's own implementation
is Go, so this driver implements it itself):
- path in the container: CONTAINER_METADATA_ROOT/resourceclaims/<claim>/<request>/<driver>-metadata.json
  for a claim the pod names, resourceclaimtemplates/<pod claim name>/<request>/... for one made
  from a template (the claim's `resource.kubernetes.io/pod-claim-name` annotation); <request> is
  the top-level request name (a firstAvailable subrequest is spelt in full inside the file);
- content: a stream of DeviceMetadata objects, the same metadata once per API version, newest
  first (metadata.resource.k8s.io/v1beta1, then v1alpha1 for older readers);
- metadata.generation 1 (the file never changes while the claim is prepared);
- read-only: a single-file read-only bind mount from the plugin's claim directory (CDI).

Each device carries the attributes this node publishes for it in its ResourceSlice (read from
the API server at prepare, so they are exactly what selectors saw), plus the limits the plugin
enforces for this claim on it: `memoryLimit` (bytes), `smLimit` (percent), `computePolicy`,
`priority` (unqualified names: the driver's own domain).

The claim's one CDI device mounts the files of all its requests: a container that names any
request of the claim gets every GPU of the claim (driver/claimspec.py), and so sees what each
request holds.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver.claims import AllocatedDevice, ClaimPlan
from sharing.claimlayout import CONTAINER_METADATA_ROOT

log = logging.getLogger(__name__)

API_VERSIONS = ("metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1")
KIND = "DeviceMetadata"
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")

Attributes = Mapping[str, Mapping[str, Any]]  # device name -> its published attributes


@dataclass(frozen=True)
class MetadataFile:
    request: str  # top-level request name: the host file is <request>.json
    container_path: str
    content: bytes


def limit_attributes(d: AllocatedDevice) -> dict[str, Any]:
    return {
        "memoryLimit": {"int": d.memory_limit},
        "smLimit": {"int": d.sm_limit},
        "computePolicy": {"string": d.config.compute_policy},
        "priority": {"int": d.config.priority},
    }


def pod_claim_name(claim_meta: Mapping[str, Any]) -> str | None:
    """The pod's name for a claim made from a template (its annotation), else None."""
    pod_claim = (claim_meta.get("annotations") or {}).get(POD_CLAIM_ANNOTATION)
    if pod_claim is None:
        return None
    if isinstance(pod_claim, str) and _DNS_LABEL.fullmatch(pod_claim):
        return pod_claim
    log.warning("claim %s: annotation %s=%r is not a pod claim name (a DNS label); its "
                "metadata goes under resourceclaims/", claim_meta.get("name"),
                POD_CLAIM_ANNOTATION, pod_claim)  # fmt: skip
    return None


def metadata_requests(claim_name: str, request_names: Iterable[str]) -> list[str]:
    """The top-level requests that get a metadata file (metadata_files' rules: a claim name
    that can be a path, a request name that can be a path component), in order."""
    if not _DNS_SUBDOMAIN.fullmatch(claim_name):
        return []
    tops = [r.split("/")[0] for r in request_names]
    return list(dict.fromkeys(t for t in tops if _DNS_LABEL.fullmatch(t)))


def metadata_files(
    plan: ClaimPlan,
    claim_meta: Mapping[str, Any],
    driver_name: str,
    published: Attributes,
) -> list[MetadataFile]:
    """One file per top-level request of the plan's devices, in request order."""
    name = str(claim_meta.get("name", ""))
    if not _DNS_SUBDOMAIN.fullmatch(name):  # the API server's rule; never a path trick
        log.warning("claim %s: name %r cannot be a path; no device metadata", plan.ref, name)
        return []
    by_request: dict[str, list[AllocatedDevice]] = {}
    for d in plan.devices:
        top = d.request.split("/")[0]
        if not _DNS_LABEL.fullmatch(top):
            log.warning("claim %s: request name %r cannot be a path; no device metadata for it",
                        plan.ref, d.request)  # fmt: skip
            continue
        by_request.setdefault(top, []).append(d)
    pod_claim = pod_claim_name(claim_meta)
    where = f"resourceclaimtemplates/{pod_claim}" if pod_claim else f"resourceclaims/{name}"
    base = f"{CONTAINER_METADATA_ROOT}/{where}"
    out = []
    for top, devices in by_request.items():
        objects = [
            # podClaimName is a field of v1beta1; v1alpha1 readers find the path enough
            _object(version, claim_meta, devices, driver_name, published,
                    pod_claim if version == API_VERSIONS[0] else None)
            for version in API_VERSIONS
        ]  # fmt: skip
        content = "".join(json.dumps(o, indent=2) + "\n" for o in objects).encode()
        out.append(MetadataFile(top, f"{base}/{top}/{driver_name}-metadata.json", content))
    return out


def _object(
    version: str,
    claim_meta: Mapping[str, Any],
    devices: Sequence[AllocatedDevice],
    driver_name: str,
    published: Attributes,
    pod_claim: str | None,
) -> dict[str, Any]:
    requests: dict[str, list[dict[str, Any]]] = {}
    for d in devices:
        attrs = dict(published.get(d.device) or {})
        attrs.update(limit_attributes(d))
        requests.setdefault(d.request, []).append(
            {"driver": driver_name, "pool": d.pool, "name": d.device, "attributes": attrs}
        )
    obj: dict[str, Any] = {
        "apiVersion": version,
        "kind": KIND,
        "metadata": {
            "name": claim_meta.get("name"),
            "namespace": claim_meta.get("namespace"),
            "uid": claim_meta.get("uid"),
            "generation": 1,
        },
    }
    if pod_claim is not None:
        obj["podClaimName"] = pod_claim
    obj["requests"] = [{"name": r, "devices": devs} for r, devs in requests.items()]
    return obj


def published_attributes(slices: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Device name -> attributes, from this node's ResourceSlices of this driver."""
    out: dict[str, dict[str, Any]] = {}
    for s in slices:
        for dev in (s.get("spec") or {}).get("devices") or []:
            if isinstance(dev, dict) and isinstance(dev.get("name"), str):
                out[dev["name"]] = dict(dev.get("attributes") or {})
    return out

"""A small, strict stand-in for the Kubernetes API server, served over real HTTP.

Usage::

    with FakeApiServer() as server:                      # 127.0.0.1:<free port>, in a thread
        api = kubernetes.client.ResourceV1Api(server.api_client())
        server.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}})
        ...
        server.objects("ResourceSlice")                  # stored dicts, as the server holds them
        server.get("ResourceClaim", "default", "claim")  # a dict, or None
        path = server.kubeconfig_path(tmp_path)          # for subprocesses (KUBECONFIG=path)

What it serves (resources in RESOURCES) is what the plugin uses: get, list, create (with
dryRun), update (PUT) and delete of single objects; server-side apply (PATCH,
application/apply-patch+yaml) of a ResourceClaim's `status.devices` on its status subresource;
GET /version (`server_version`). List honours fieldSelector (metadata.name,
metadata.namespace and the kind's own fields, e.g. spec.nodeName and spec.driver for
ResourceSlices; any other field is a 400 as on a real server). Anything else (watch, other
patches, deletecollection, labelSelector, other subresources) is refused with an error, never
half-served. `claim_status="forbid"` answers that status apply with 403 (the RBAC rule for
resourceclaims/driver missing), `"absent"` with 404.

Strictness: every write (and put()) is validated against kubernetes-validate's strict schemas of
every version in VALIDATE_VERSIONS, plus the semantic rules the real server enforces on
ResourceSlices (names, one node selection, at most 128 devices, attribute kinds, semver,
request policies); a violation is HTTP 422 with a Status body like the real server's.

`drop_consumable_capacity=True` strips `allowMultipleAllocations` and capacity `requestPolicy`
from ResourceSlice writes, as a server with the DRAConsumableCapacity gate off does (the 1.34 and
1.35 default), and likewise claims' `capacity` requests and results' `consumedCapacity`/`shareID`. `drop_device_taints=True` strips device `taints` (gate DRADeviceTaints off).

Deleting an object deletes the objects whose ownerReferences name its UID (what the garbage
collector does, here at once). `down()` closes the listening socket (clients get "connection refused") and `up()` serves the
same store on the same port again, for API-server-outage tests. `requests` records every request.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes.client
import kubernetes_validate
import yaml

from sharing import kubequantity

VALIDATE_VERSIONS: tuple[str, ...] = ("1.34", "1.35")


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    # Field selectors the real server accepts beyond metadata.name/metadata.namespace.
    field_selectors: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "nodes", "Node", namespaced=False),
    ResourceType("", "v1", "namespaces", "Namespace", namespaced=False),
    ResourceType("", "v1", "events", "Event", namespaced=True),
    ResourceType(
        "",
        "v1",
        "pods",
        "Pod",
        namespaced=True,
        field_selectors=("spec.nodeName", "status.phase"),
    ),
    ResourceType(
        "resource.k8s.io",
        "v1",
        "resourceslices",
        "ResourceSlice",
        namespaced=False,
        field_selectors=("spec.nodeName", "spec.driver"),
    ),
    ResourceType("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", namespaced=True),
    ResourceType(
        "resource.k8s.io",
        "v1",
        "resourceclaimtemplates",
        "ResourceClaimTemplate",
        namespaced=True,
    ),
    ResourceType("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", namespaced=False),
)


class ApiError(Exception):
    """An HTTP error answered with a Status body."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def _invalid(rt: ResourceType, name: str, causes: list[tuple[str, str]]) -> ApiError:
    """A 422 like the real server's: `Kind "name" is invalid: field: message, ...`."""
    text = ", ".join(f"{f}: {m}" for f, m in causes)
    return ApiError(
        422,
        "Invalid",
        f'{rt.kind} "{name}" is invalid: {text}',
        {
            "name": name,
            "group": rt.group,
            "kind": rt.kind,
            "causes": [
                {"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes
            ],
        },
    )


# --- quantities, names and semver, as the real validation defines them ---------------------------


def parse_quantity(value: Any) -> Fraction:
    """A Kubernetes quantity (string or number) as an exact fraction; ValueError if malformed
    (the project's one Kubernetes-quantity rule, sharing/kubequantity.py)."""
    return Fraction(kubequantity.parse(value))


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_C_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


def _dns_subdomain_error(value: str, max_len: int = 253) -> str | None:
    if not value or len(value) > max_len:
        return f"must be 1-{max_len} characters"
    if not all(_DNS_LABEL.match(part) for part in value.split(".")):
        return "must be a lowercase RFC 1123 subdomain (a-z, 0-9, '-', '.')"
    return None


def _dns_label_error(value: str) -> str | None:
    if not value or len(value) > 63 or not _DNS_LABEL.match(value):
        return "must be a lowercase RFC 1123 label (a-z, 0-9, '-'; at most 63 characters)"
    return None


def _qualified_name_error(value: str) -> str | None:
    """Attribute/capacity names: `[domain/]identifier` (identifier: C identifier, <= 64)."""
    domain, _, ident = value.rpartition("/")
    if domain and (err := _dns_subdomain_error(domain, 63)):
        return f"domain {domain!r} {err}"
    if not _C_IDENT.match(ident) or len(ident) > 64:
        return f"name {ident!r} must be a C identifier of at most 64 characters"
    return None


# --- ResourceSlice semantics (the subset of the real server's validation that drivers trip on) ---

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32


def _validate_request_policy(
    path: str, value: Fraction, policy: Mapping[str, Any], errs: list[tuple[str, str]]
) -> None:
    try:
        default = parse_quantity(policy["default"]) if "default" in policy else None
        valid_values = [parse_quantity(v) for v in policy.get("validValues") or []]
        vr = policy.get("validRange")
        rng = {k: parse_quantity(v) for k, v in (vr or {}).items()}
    except ValueError as e:
        errs.append((path, str(e)))
        return
    if valid_values and vr:
        errs.append((path, "validValues and validRange are mutually exclusive"))
    if default is not None and default > value:
        errs.append((f"{path}.default", "must be less than or equal to the capacity value"))
    if valid_values:
        if len(valid_values) > 10:
            errs.append((f"{path}.validValues", "must have at most 10 items"))
        if any(b <= a for a, b in itertools.pairwise(valid_values)):
            errs.append(
                (f"{path}.validValues", "must be sorted in ascending order without duplicates")
            )
        if default is None or default not in valid_values:
            errs.append((f"{path}.default", "must be one of validValues"))
        if any(v > value for v in valid_values):
            errs.append((f"{path}.validValues", "must be less than or equal to the capacity value"))
    if vr is not None:
        lo, hi, step = rng.get("min"), rng.get("max"), rng.get("step")
        r = f"{path}.validRange"
        if lo is None:
            errs.append((f"{r}.min", "Required value"))
            return
        if lo < 0 or lo > value:
            errs.append((f"{r}.min", "must be between zero and the capacity value"))
        if hi is not None and (hi < lo or hi > value):
            errs.append((f"{r}.max", "must be between min and the capacity value"))
        if default is None:
            errs.append((f"{path}.default", "Required value: validRange needs a default"))
        elif default < lo or (hi is not None and default > hi):
            errs.append((f"{path}.default", "must lie within validRange"))
        if step is not None:
            if step <= 0:
                errs.append((f"{r}.step", "must be positive"))
                return
            if lo + step > value:
                errs.append(
                    (f"{r}.step", "min + step must be less than or equal to the capacity value")
                )
            if default is not None and (default - lo) % step:
                errs.append((f"{path}.default", "default - min must be a multiple of step"))
            if hi is not None and (hi - lo) % step:
                errs.append((f"{r}.max", "max - min must be a multiple of step"))


def validate_resource_slice(obj: Mapping[str, Any]) -> list[tuple[str, str]]:
    errs: list[tuple[str, str]] = []
    spec = obj.get("spec") or {}
    if err := _dns_subdomain_error(str(spec.get("driver", "")), 63):
        errs.append(("spec.driver", err))
    pool = spec.get("pool") or {}
    pool_name = str(pool.get("name", ""))
    if not pool_name or any(_dns_subdomain_error(p) for p in pool_name.split("/")):
        errs.append(("spec.pool.name", "must be one or more DNS subdomains separated by '/'"))
    if int(pool.get("generation", 0)) < 0:
        errs.append(("spec.pool.generation", "must be greater than or equal to 0"))
    if int(pool.get("resourceSliceCount", 0)) < 1:
        errs.append(("spec.pool.resourceSliceCount", "must be greater than 0"))
    chosen = [
        k
        for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
        if spec.get(k) not in (None, "", False)
    ]
    if len(chosen) != 1:
        errs.append(
            (
                "spec",
                "exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                f"`perDeviceNodeSelection` is required, got {chosen or 'none'}",
            )
        )
    if spec.get("nodeName") and (err := _dns_subdomain_error(spec["nodeName"])):
        errs.append(("spec.nodeName", err))
    devices = spec.get("devices") or []
    limit = MAX_DEVICES_PER_SLICE
    if any(d.get("taints") or d.get("consumesCounters") for d in devices):
        limit = MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
    if len(devices) > limit:
        errs.append(("spec.devices", f"Too many: {len(devices)}: must have at most {limit} items"))
    seen: set[str] = set()
    for i, dev in enumerate(devices):
        p = f"spec.devices[{i}]"
        name = str(dev.get("name", ""))
        if err := _dns_label_error(name):
            errs.append((f"{p}.name", err))
        if name in seen:
            errs.append((f"{p}.name", f"Duplicate value: {name!r}"))
        seen.add(name)
        attrs = dev.get("attributes") or {}
        caps = dev.get("capacity") or {}
        if len(attrs) + len(caps) > MAX_ATTRIBUTES_AND_CAPACITIES:
            errs.append((p, f"at most {MAX_ATTRIBUTES_AND_CAPACITIES} attributes and capacities"))
        for key, attr in attrs.items():
            ap = f"{p}.attributes[{key}]"
            if err := _qualified_name_error(key):
                errs.append((ap, err))
            set_fields = [
                k for k in ("int", "bool", "string", "version") if attr.get(k) is not None
            ]
            if len(set_fields) != 1:
                errs.append((ap, "exactly one value must be specified"))
            if "version" in set_fields and not _SEMVER.match(str(attr["version"])):
                errs.append((f"{ap}.version", f"{attr['version']!r} must be a semantic version"))
            if "string" in set_fields and len(str(attr["string"])) > 64:
                errs.append((f"{ap}.string", "must be at most 64 characters"))
        for key, cap in caps.items():
            cp = f"{p}.capacity[{key}]"
            if err := _qualified_name_error(key):
                errs.append((cp, err))
            try:
                value = parse_quantity(cap.get("value"))
            except ValueError as e:
                errs.append((f"{cp}.value", str(e)))
                continue
            policy = cap.get("requestPolicy")
            if policy is not None:
                if not dev.get("allowMultipleAllocations"):
                    errs.append(
                        (
                            f"{cp}.requestPolicy",
                            "only allowed when allowMultipleAllocations is true",
                        )
                    )
                _validate_request_policy(f"{cp}.requestPolicy", value, policy, errs)
    return errs


# --- field selectors -----------------------------------------------------------------------------


def _field(obj: Mapping[str, Any], dotted: str) -> str:
    cur: Any = obj
    for part in dotted.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)


def _parse_field_selector(rt: ResourceType, text: str) -> list[tuple[str, str, bool]]:
    """[(field, value, equal)]; a field the kind does not support is a 400 as on a real server."""
    terms: list[tuple[str, str, bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        m = re.match(r"^([^!=]+)(==|!=|=)(.*)$", term)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector: {term!r}")
        name = m.group(1).strip()
        if name not in ("metadata.name", "metadata.namespace", *rt.field_selectors):
            raise ApiError(
                400,
                "BadRequest",
                f'Unable to find "{rt.group}/{rt.version}, Resource={rt.plural}" '
                f'that match label selector "", field selector "{text}": '
                f"field label not supported: {name}",
            )
        terms.append((name, m.group(3).strip(), m.group(2) != "!="))
    return terms


# --- the server ---


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str


@dataclass
class _Store:
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    rv: int = 0


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-connection (a test closing its client, the plugin stopping)
    is normal for an API server: no traceback on stderr. Anything else is still reported."""

    def handle_error(self, request: object, client_address: object) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class FakeApiServer:
    """See the module docstring."""

    def __init__(
        self,
        *,
        drop_consumable_capacity: bool = False,
        drop_device_taints: bool = False,
        validate_versions: tuple[str, ...] = VALIDATE_VERSIONS,
        port: int = 0,
        server_version: str = "1.36",
        claim_status: str = "serve",
    ) -> None:
        self.drop_consumable_capacity = drop_consumable_capacity
        self.server_version = server_version
        if claim_status not in ("serve", "forbid", "absent"):
            raise ValueError(f"claim_status {claim_status!r}; allowed: serve, forbid, absent")
        self.claim_status = claim_status
        # server-side apply's ownership of status.devices entries: (claim uid, fieldManager) ->
        # the keys that manager's last apply listed
        self._status_owned: dict[tuple[str, str], set[tuple[Any, ...]]] = {}
        self.drop_device_taints = drop_device_taints
        self.validate_versions = validate_versions
        self.requests: list[RecordedRequest] = []
        self._store = _Store()
        self._cond = threading.Condition()
        self._port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    # -- lifecycle --

    def __enter__(self) -> FakeApiServer:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def serving(self) -> bool:
        return self._httpd is not None

    def count(self, method: str, resource: str) -> int:
        """Requests recorded so far with this method on this resource's paths ("resourceclaims")."""
        return sum(1 for r in self.requests if r.method == method and resource in r.path)

    def up(self) -> None:
        """Start serving (again): on a free port the first time, the same port after down()."""
        if self._httpd is not None:
            return
        server = self

        class Handler(_Handler):
            api = server

        deadline = time.monotonic() + 10
        while True:
            try:
                httpd = _QuietServer(("127.0.0.1", self._port), Handler)
                break
            except OSError:
                # The old socket of down() may linger for a moment; the port is ours to retake.
                if self._port == 0 or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        httpd.daemon_threads = True
        self._httpd = httpd
        self._port = httpd.server_address[1]
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def down(self) -> None:
        """Stop listening and cut open connections; the store survives for up()."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        # Keep-alive connections would go on being served by their threads: cut them, as a dead
        # server does, so clients see the outage.
        with self._conns_lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- clients --

    def api_client(self) -> kubernetes.client.ApiClient:
        cfg = kubernetes.client.Configuration()
        cfg.host = self.url
        return kubernetes.client.ApiClient(cfg)

    def kubeconfig_path(self, directory: str | Path) -> Path:
        path = Path(directory) / "kubeconfig"
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(cfg))
        return path

    # -- direct access for tests --

    @staticmethod
    def resource_type(kind: str) -> ResourceType:
        for rt in RESOURCES:
            if kind.lower() in (rt.kind.lower(), rt.plural):
                return rt
        raise KeyError(f"unknown kind {kind!r}; served: {', '.join(r.kind for r in RESOURCES)}")

    def put(self, obj: Any) -> dict[str, Any]:
        """Create or replace an object as given (status included), validated like a write."""
        if not isinstance(obj, dict):
            obj = kubernetes.client.ApiClient().sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
        rt = self.resource_type(obj["kind"])
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace", "default") if rt.namespaced else ""
        with self._cond:
            old = self._store.objects.get((rt.plural, ns, meta.get("name", "")))
            return self._write(rt, ns, copy.deepcopy(obj), old)

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        rt = self.resource_type(kind)
        with self._cond:
            ns = (namespace or "") if rt.namespaced else ""
            obj = self._store.objects.get((rt.plural, ns, name))
            return copy.deepcopy(obj) if obj is not None else None

    def objects(self, kind: str) -> list[dict[str, Any]]:
        rt = self.resource_type(kind)
        with self._cond:
            return [
                copy.deepcopy(o)
                for (plural, _, _), o in sorted(self._store.objects.items())
                if plural == rt.plural
            ]

    def delete(self, kind: str, namespace: str | None, name: str) -> None:
        rt = self.resource_type(kind)
        with self._cond:
            self._delete(rt, (namespace or "") if rt.namespaced else "", name)

    def wait_for(self, predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
        """Block until predicate(self) holds (checked on every write); AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
                self._cond.wait(min(left, 0.2))

    # -- the store (call with self._cond held) --

    def _validate(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        for version in self.validate_versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.absolute_path) or "<root>"
                raise _invalid(rt, name, [(where, f"{e.message} (schema {version} strict)")]) from e
        if rt.kind == "ResourceSlice" and (errs := validate_resource_slice(obj)):
            raise _invalid(rt, name, errs)

    def _strip_gated_fields(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        """Drop what a server with the gate off drops on write (silently, no error)."""
        if rt.kind == "ResourceSlice":
            for dev in (obj.get("spec") or {}).get("devices") or []:
                if self.drop_consumable_capacity:
                    dev.pop("allowMultipleAllocations", None)
                    for cap in (dev.get("capacity") or {}).values():
                        cap.pop("requestPolicy", None)
                if self.drop_device_taints:
                    dev.pop("taints", None)
            return
        if not self.drop_consumable_capacity:
            return
        if rt.kind in ("ResourceClaim", "ResourceClaimTemplate"):
            spec = obj.get("spec") or {}
            if rt.kind == "ResourceClaimTemplate":
                spec = spec.get("spec") or {}
            for req in (spec.get("devices") or {}).get("requests") or []:
                (req.get("exactly") or {}).pop("capacity", None)
                for sub in req.get("firstAvailable") or []:
                    sub.pop("capacity", None)
        if rt.kind == "ResourceClaim":
            allocation = (obj.get("status") or {}).get("allocation") or {}
            for res in (allocation.get("devices") or {}).get("results") or []:
                res.pop("consumedCapacity", None)
                res.pop("shareID", None)

    def _write(
        self,
        rt: ResourceType,
        ns: str,
        obj: dict[str, Any],
        old: dict[str, Any] | None,
        *,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        obj.setdefault("apiVersion", rt.api_version)
        obj.setdefault("kind", rt.kind)
        if obj["apiVersion"] != rt.api_version or obj["kind"] != rt.kind:
            raise ApiError(
                400,
                "BadRequest",
                f"the body is {obj['apiVersion']}/{obj['kind']}, expected "
                f"{rt.api_version}/{rt.kind}",
            )
        meta = obj.setdefault("metadata", {})
        if rt.namespaced:
            if meta.get("namespace", ns) != ns:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on "
                    "the request",
                )
            meta["namespace"] = ns
        if not meta.get("name"):
            if meta.get("generateName") and old is None:
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            else:
                raise _invalid(
                    rt, "", [("metadata.name", "Required value: name or generateName is required")]
                )
        if err := _dns_subdomain_error(meta["name"]):
            raise _invalid(rt, meta["name"], [("metadata.name", err)])
        if old is not None:
            rv = meta.get("resourceVersion")
            if rv and rv != old["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {rt.plural}.{rt.group} "{meta["name"]}": '
                    "the object has been modified; please apply your changes to the latest "
                    "version and try again",
                    {"name": meta["name"], "group": rt.group, "kind": rt.plural},
                )
            meta["uid"] = old["metadata"]["uid"]
            meta["creationTimestamp"] = old["metadata"]["creationTimestamp"]
            generation = int(old["metadata"].get("generation", 1))
            if obj.get("spec") != old.get("spec"):
                generation += 1
            meta["generation"] = generation
        else:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["creationTimestamp"] = _now()
            meta["generation"] = 1
        meta.pop("resourceVersion", None)
        self._strip_gated_fields(rt, obj)
        self._validate(rt, obj)
        if dry_run:
            return obj
        self._store.rv += 1
        meta["resourceVersion"] = str(self._store.rv)
        self._store.objects[(rt.plural, ns, meta["name"])] = obj
        self._cond.notify_all()
        return copy.deepcopy(obj)

    def _delete(self, rt: ResourceType, ns: str, name: str) -> dict[str, Any]:
        obj = self._store.objects.pop((rt.plural, ns, name), None)
        if obj is None:
            raise _not_found(rt, name)
        self._store.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self._store.rv)
        self._cond.notify_all()
        # The garbage collector's part: dependents of the deleted object go too (at once here).
        uid = obj["metadata"].get("uid")
        for (plural, dns, dname), dep in list(self._store.objects.items()):
            owners = (dep.get("metadata") or {}).get("ownerReferences") or []
            if uid and any(o.get("uid") == uid for o in owners):
                drt = self.resource_type(plural)
                if (plural, dns, dname) in self._store.objects:
                    self._delete(drt, dns, dname)
        return obj

    def _list(
        self, rt: ResourceType, ns: str | None, query: Mapping[str, list[str]]
    ) -> list[dict[str, Any]]:
        fields = _parse_field_selector(rt, query.get("fieldSelector", [""])[0])
        return [
            copy.deepcopy(o)
            for (plural, ons, _), o in sorted(self._store.objects.items())
            if plural == rt.plural
            and (ns is None or ons == ns)
            and all((_field(o, f) == v) == eq for f, v, eq in fields)
        ]


def _not_found(rt: ResourceType, name: str) -> ApiError:
    what = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
    return ApiError(
        404,
        "NotFound",
        f'{what} "{name}" not found',
        {"name": name, "group": rt.group, "kind": rt.plural},
    )


_PATH = re.compile(
    r"^/(?:api/(?P<cv>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?"
    r"(?:/(?P<sub>status))?/?$"
)


class _Handler(BaseHTTPRequestHandler):
    api: FakeApiServer
    protocol_version = "HTTP/1.1"
    # As a real (Go) API server does: headers and body go out in two writes, and with Nagle on
    # every response would wait for the client's delayed ACK (~40 ms).
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        with self.api._conns_lock:
            self.api._conns.add(self.connection)

    def finish(self) -> None:
        with self.api._conns_lock:
            self.api._conns.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean; FakeApiServer.requests records every request

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _send(self, code: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError as e:
            raise ApiError(400, "BadRequest", f"request body is not JSON: {e}") from e

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        self.api.requests.append(RecordedRequest(method, url.path, query, ctype))
        try:
            body = self._body() if method in ("POST", "PUT", "DELETE", "PATCH") else None
            if method == "GET" and url.path.rstrip("/") == "/version":
                major, minor = self.api.server_version.split(".")
                self._send(200, {"major": major, "minor": minor,
                                 "gitVersion": f"v{major}.{minor}.0"})  # fmt: skip
                return
            m = _PATH.match(url.path)
            if not m:
                raise ApiError(
                    404,
                    "NotFound",
                    f"the server could not find the requested resource ({url.path})",
                )
            group = m.group("group") or ""
            version = m.group("cv") or m.group("version")
            rt = next(
                (
                    r
                    for r in RESOURCES
                    if (r.group, r.version, r.plural) == (group, version, m.group("plural"))
                ),
                None,
            )
            if rt is None or (m.group("ns") is not None and not rt.namespaced):
                raise ApiError(
                    404,
                    "NotFound",
                    f"the server could not find the requested resource ({url.path})",
                )
            if rt.namespaced and m.group("ns") is None and (method != "GET" or m.group("name")):
                raise ApiError(
                    404, "NotFound", f"{rt.kind} is namespaced: use /namespaces/<ns>/{rt.plural}"
                )
            if m.group("sub") or method == "PATCH":
                self._status(method, rt, m.group("ns"), m.group("name"), query, ctype, body)
                return
            self._handle(method, rt, m.group("ns"), m.group("name"), query, body)
        except ApiError as e:
            self._send(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _handle(
        self,
        method: str,
        rt: ResourceType,
        ns: str | None,
        name: str | None,
        query: Mapping[str, list[str]],
        body: Any,
    ) -> None:
        api = self.api
        key_ns = ns or ""
        unsupported = sorted(set(query) & {"watch", "labelSelector"})
        if unsupported:
            raise ApiError(400, "BadRequest", f"this fake does not serve {', '.join(unsupported)}")
        if method == "GET" and name is None:
            with api._cond:
                items = api._list(rt, ns, query)
                rv = str(api._store.rv)
            for item in items:
                # A real server leaves kind/apiVersion out of list items.
                item.pop("kind", None)
                item.pop("apiVersion", None)
            self._send(
                200,
                {
                    "kind": f"{rt.kind}List",
                    "apiVersion": rt.api_version,
                    "metadata": {"resourceVersion": rv},
                    "items": items,
                },
            )
            return
        if name is None and method != "POST":
            raise ApiError(405, "MethodNotAllowed", f"{method} needs an object name")
        if name is not None and method == "POST":
            raise ApiError(405, "MethodNotAllowed", "POST goes to the collection")
        if method == "GET":
            assert name is not None
            with api._cond:
                obj = api._store.objects.get((rt.plural, key_ns, name))
                if obj is None:
                    raise _not_found(rt, name)
                self._send(200, obj)
            return
        if method == "DELETE":
            assert name is not None
            with api._cond:
                obj = api._delete(rt, key_ns, name)
            self._send(200, obj)
            return
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body must be a JSON object")
        dry_run = bool(query.get("dryRun"))
        with api._cond:
            if method == "POST":
                meta = body.get("metadata") or {}
                if meta.get("name") and (rt.plural, key_ns, meta["name"]) in api._store.objects:
                    what = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
                    raise ApiError(
                        409,
                        "AlreadyExists",
                        f'{what} "{meta["name"]}" already exists',
                        {"name": meta["name"], "group": rt.group, "kind": rt.plural},
                    )
                obj = api._write(rt, key_ns, body, None, dry_run=dry_run)
                code = 201
            else:  # PUT
                assert name is not None
                old = api._store.objects.get((rt.plural, key_ns, name))
                if old is None:
                    raise _not_found(rt, name)
                if (body.get("metadata") or {}).get("name", name) != name:
                    raise ApiError(
                        400, "BadRequest", "the name of the object does not match the URL"
                    )
                body.setdefault("metadata", {})["name"] = name
                obj = api._write(rt, key_ns, body, old, dry_run=dry_run)
                code = 200
        self._send(code, obj)

    def _status(
        self,
        method: str,
        rt: ResourceType,
        ns: str | None,
        name: str | None,
        query: Mapping[str, list[str]],
        ctype: str,
        body: Any,
    ) -> None:
        """The ResourceClaim status subresource, server-side apply only (what the plugin uses):
        our `status.devices` entries are merged by their key (driver, pool, device, shareID);
        an entry must name an allocated device, as the real server's validation demands. As
        server-side apply does, an entry the same fieldManager applied before and leaves out now
        is removed unless another manager applied it too (entries written otherwise stay); a
        metadata.uid that is not the object's is a conflict."""
        api = self.api
        if rt.kind != "ResourceClaim" or method != "PATCH" or name is None or ns is None:
            raise ApiError(
                405,
                "MethodNotAllowed",
                f"this fake serves only PATCH of resourceclaims/<name>/status, not {method}",
            )
        if api.claim_status == "absent":
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if api.claim_status == "forbid":
            raise ApiError(
                403,
                "Forbidden",
                f'resourceclaims.resource.k8s.io "{name}" is forbidden: User cannot '
                'associated-node:patch resource "resourceclaims/driver"',
            )
        if ctype != "application/apply-patch+yaml":
            raise ApiError(415, "UnsupportedMediaType", f"this fake applies only; got {ctype!r}")
        if not query.get("fieldManager"):
            raise ApiError(400, "BadRequest", "fieldManager is required for apply patch")
        if not isinstance(body, dict) or set(body) - {"apiVersion", "kind", "metadata", "status"}:
            raise ApiError(
                400,
                "BadRequest",
                "an apply of the status sends only the object's identity and status",
            )
        if set(body.get("status") or {}) != {"devices"}:
            raise ApiError(400, "BadRequest", "this fake applies status.devices only")

        def key(e: Mapping[str, Any]) -> tuple[Any, ...]:
            return (e.get("driver"), e.get("pool"), e.get("device"), e.get("shareID"))

        with api._cond:
            old = api._store.objects.get((rt.plural, ns, name))
            if old is None:
                raise _not_found(rt, name)
            uid = old["metadata"].get("uid")
            want_uid = (body.get("metadata") or {}).get("uid")
            if want_uid and want_uid != uid:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on resourceclaims.{rt.group} "{name}": '
                    f"Precondition failed: UID in precondition: {want_uid}, UID in object meta: "
                    f"{uid}",
                )
            manager = query["fieldManager"][0]
            obj = copy.deepcopy(old)
            status = obj.setdefault("status", {})
            results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
            allocated = {key(r) for r in results}
            merged = {key(e): e for e in status.get("devices") or []}
            applied = {key(e) for e in body["status"]["devices"]}
            others = set().union(
                *(ks for (u, m), ks in api._status_owned.items() if u == uid and m != manager)
            )
            for k in api._status_owned.get((uid, manager), set()) - applied - others:
                merged.pop(k, None)
            api._status_owned[(uid, manager)] = applied
            for i, e in enumerate(body["status"]["devices"]):
                if key(e) not in allocated:
                    raise _invalid(
                        rt, name, [(f"status.devices[{i}]", "Invalid value: device not allocated")]
                    )
                if len(json.dumps(e.get("data", {}))) > 10 * 1024:
                    raise _invalid(
                        rt,
                        name,
                        [(f"status.devices[{i}].data", "Too long: must have at most 10240 bytes")],
                    )
                merged[key(e)] = e
            status["devices"] = list(merged.values())
            obj["metadata"].pop("resourceVersion", None)
            out = api._write(rt, ns, obj, old)
        self._send(200, out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

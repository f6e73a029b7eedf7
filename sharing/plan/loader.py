"""Reading the inputs of `vgpu plan`; every problem is an InputError naming file and field.

Slices: a file or a directory (its *.yaml, *.yml, *.json files, recursively, in name order)
of ResourceSlices, DeviceClasses and ResourceClaims (whose allocations the plan starts from): single objects, `kind: List` / `...List` objects with
`items` (as `kubectl get -o yaml` prints them), several YAML documents, or JSON.
Workloads: `{workloads: [{name, replicas, spec: <ResourceClaimSpec>}], deviceClasses: [...]}`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import yaml

from sharing.kubequantity import KubeQuantityError as QuantityError
from sharing.kubequantity import parse, parse_bytes
from sharing.plan.model import (
    Allocated,
    AttrKind,
    AttrValue,
    BurstLimit,
    Capacity,
    ClaimSpec,
    Constraint,
    Device,
    DeviceClass,
    DeviceRequest,
    Inventory,
    Request,
    RequestPolicy,
    Taint,
    Toleration,
    ValidRange,
    Workload,
    qualify,
)
from sharing.plan.yamlread import load_all

_SUFFIXES = (".yaml", ".yml", ".json")
_ATTR_KINDS: tuple[AttrKind, ...] = ("int", "bool", "string", "version")


class InputError(ValueError):
    """Bad input. str() is one line: '<file>: <field path>: what is wrong'."""

    def __init__(self, file: Path | str, path: str, message: str) -> None:
        super().__init__(f"{file}: {path}: {message}" if path else f"{file}: {message}")


class _Ctx:
    """The file being read, for error messages."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def fail(self, path: str, message: str) -> InputError:
        return InputError(self.file, path, message)

    def mapping(self, value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping, not {_kind(value)}")
        return value

    def fields(self, value: Any, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        """A mapping whose keys are all known: a misspelled field is an error, never a default."""
        m = self.mapping(value, path)
        for key in m:
            if key not in allowed:
                raise self.fail(
                    f"{path}.{key}" if path != "(document)" else str(key),
                    f"unknown field; allowed: {', '.join(allowed)}",
                )
        return m

    def seq(self, value: Any, path: str) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(path, f"must be a list, not {_kind(value)}")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, not {_kind(value)}")
        return value

    def items(self, value: Any, path: str, what: str) -> list[Any]:
        """A list that must not be empty."""
        out = self.seq(value, path)
        if not out:
            raise self.fail(path, f"must list at least one {what}")
        return out

    def unique_name(self, obj: dict[str, Any], path: str, seen: set[str], what: str) -> str:
        name = self.string(obj.get("name"), f"{path}.name")
        if name in seen:
            raise self.fail(f"{path}.name", f"{name!r} is used by an earlier {what}")
        seen.add(name)
        return name

    def integer(self, value: Any, path: str, lo: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise self.fail(path, f"must be an integer >= {lo}, not {value!r}")
        return value

    def quantity(self, value: Any, path: str) -> Decimal:
        try:
            q = parse(value)
        except QuantityError as e:
            raise self.fail(path, str(e)) from None
        if q < 0:
            raise self.fail(path, f"{value!r} is negative")
        return q


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _documents(file: Path) -> Iterator[tuple[str, Any]]:
    """(field path prefix, object) for every object of the file, lists unpacked."""
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(file, "", f"cannot read: {e}") from None
    try:
        docs = load_all(text)
    except yaml.YAMLError as e:
        first = str(e).replace("\n", " ")
        raise InputError(file, "", f"not YAML or JSON: {first}") from None
    for n, doc in enumerate(docs):
        prefix = f"document {n}: " if len(docs) > 1 else ""
        if doc is None:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("items"), list):
            for i, item in enumerate(doc["items"]):
                yield f"{prefix}items[{i}]", item
        else:
            yield prefix.rstrip(": ") if prefix else "", doc


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES)
        if not files:
            raise InputError(path, "", "no .yaml, .yml or .json files in this directory")
        return files
    if not path.exists():
        raise InputError(path, "", "no such file or directory")
    return [path]


def _join(prefix: str, field: str) -> str:
    return f"{prefix}.{field}" if prefix else field


def load_slices(*paths: Path) -> tuple[Inventory, dict[str, DeviceClass]]:
    """Devices by node (node names sorted; pools by driver and name; slices by name; devices
    as listed) and the DeviceClasses found beside them."""
    raw: list[tuple[_Ctx, str, dict[str, Any]]] = []
    classes: dict[str, DeviceClass] = {}
    allocated: list[Allocated] = []
    files = [f for path in paths for f in _files(path)]
    for file in files:
        ctx = _Ctx(file)
        for prefix, obj in _documents(file):
            obj = ctx.mapping(obj, prefix or "(document)")
            kind = obj.get("kind")
            if kind == "DeviceClass":
                dc = parse_device_class(ctx, prefix, obj)
                classes[dc.name] = dc
            elif kind == "ResourceSlice":
                raw.append((ctx, prefix, obj))
            elif kind == "ResourceClaim":
                allocated.extend(parse_allocation(ctx, prefix, obj))
            else:
                raise ctx.fail(
                    _join(prefix, "kind"),
                    f"{kind!r} is not allowed; allowed: ResourceSlice, DeviceClass, ResourceClaim",
                )
    inv = _inventory(raw)
    inv.allocated = allocated
    return inv, classes


def parse_allocation(ctx: _Ctx, prefix: str, obj: dict[str, Any]) -> list[Allocated]:
    """The devices an existing claim holds (none when it is not allocated yet)."""
    meta = obj.get("metadata") or {}
    name = f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"
    allocation = (obj.get("status") or {}).get("allocation")
    if not allocation:
        return []
    rp = _join(prefix, "status.allocation.devices.results")
    results = ctx.seq(((allocation.get("devices") or {}).get("results")), rp)
    out = []
    for i, raw in enumerate(results):
        r = ctx.mapping(raw, f"{rp}[{i}]")
        consumed = None
        if r.get("consumedCapacity") is not None:
            cp = f"{rp}[{i}].consumedCapacity"
            consumed = {
                str(k): ctx.quantity(v, f"{cp}.{k}")
                for k, v in ctx.mapping(r["consumedCapacity"], cp).items()
            }
        out.append(
            Allocated(
                name,
                ctx.string(r.get("driver"), f"{rp}[{i}].driver"),
                ctx.string(r.get("pool"), f"{rp}[{i}].pool"),
                ctx.string(r.get("device"), f"{rp}[{i}].device"),
                consumed,
            )
        )
    return out


def _inventory(raw: list[tuple[_Ctx, str, dict[str, Any]]]) -> Inventory:
    inv = Inventory()
    # pool (driver, name) -> generation -> [(slice name, node, devices)]
    pools: dict[tuple[str, str], dict[int, list[tuple[str, str, list[Device]]]]] = {}
    counts: dict[tuple[str, str, int], int] = {}
    for ctx, prefix, obj in raw:
        spec = ctx.mapping(obj.get("spec"), _join(prefix, "spec"))
        sp = _join(prefix, "spec")
        name = str((obj.get("metadata") or {}).get("name") or f"{ctx.file}:{prefix}")
        driver = ctx.string(spec.get("driver"), f"{sp}.driver")
        pool = ctx.mapping(spec.get("pool"), f"{sp}.pool")
        pool_name = ctx.string(pool.get("name"), f"{sp}.pool.name")
        generation = ctx.integer(pool.get("generation", 0), f"{sp}.pool.generation", 0)
        slice_count = ctx.integer(
            pool.get("resourceSliceCount", 1), f"{sp}.pool.resourceSliceCount", 1
        )
        node = spec.get("nodeName")
        if not node:
            inv.warnings.append(
                f"{ctx.file}: {sp}: slice {name} has no nodeName (allNodes/nodeSelector): "
                "vgpu plan plans node-local devices only; left out"
            )
            continue
        node = ctx.string(node, f"{sp}.nodeName")
        devices = [
            parse_device(ctx, f"{sp}.devices[{i}]", d, node, driver, pool_name)
            for i, d in enumerate(ctx.seq(spec.get("devices"), f"{sp}.devices"))
        ]
        raw_devices = ctx.seq(spec.get("devices"), f"{sp}.devices")
        if any(isinstance(d, dict) and d.get("consumesCounters") for d in raw_devices):
            inv.warnings.append(
                f"{ctx.file}: {sp}: slice {name} has devices with consumesCounters "
                "(partitionable devices): their shared counters are not checked"
            )
        pools.setdefault((driver, pool_name), {}).setdefault(generation, []).append(
            (name, node, devices)
        )
        counts[(driver, pool_name, generation)] = slice_count
    for (driver, pool_name), gens in sorted(pools.items()):
        newest = max(gens)
        slices = sorted(gens[newest])
        want = counts[(driver, pool_name, newest)]
        if len(slices) < want:
            inv.warnings.append(
                f"pool {pool_name} of driver {driver}: {len(slices)} of {want} ResourceSlices "
                f"of generation {newest}; an incomplete pool is not allocated from; left out"
            )
            continue
        for _, node, devices in slices:
            inv.nodes.setdefault(node, []).extend(devices)
    inv.nodes = dict(sorted(inv.nodes.items()))
    index = 0
    for devices in inv.nodes.values():
        for d in devices:
            d.index = index
            index += 1
    return inv


def parse_device(ctx: _Ctx, path: str, raw: Any, node: str, driver: str, pool: str) -> Device:
    d = ctx.mapping(raw, path)
    name = ctx.string(d.get("name"), f"{path}.name")
    attrs: dict[str, AttrValue] = {}
    for key, value in ctx.mapping(d.get("attributes") or {}, f"{path}.attributes").items():
        ap = f"{path}.attributes.{key}"
        v = ctx.mapping(value, ap)
        kinds = [k for k in _ATTR_KINDS if k in v]
        if len(kinds) != 1:
            raise ctx.fail(ap, "must have exactly one of int, bool, string, version")
        kind = kinds[0]
        val = v[kind]
        ok = {
            "int": isinstance(val, int) and not isinstance(val, bool),
            "bool": isinstance(val, bool),
            "string": isinstance(val, str),
            "version": isinstance(val, str),
        }[kind]
        if not ok:
            raise ctx.fail(f"{ap}.{kind}", f"{val!r} is not a {kind}")
        attrs[qualify(str(key), driver)] = (kind, val)
    caps: dict[str, Capacity] = {}
    for key, value in ctx.mapping(d.get("capacity") or {}, f"{path}.capacity").items():
        cp = f"{path}.capacity.{key}"
        c = ctx.mapping(value, cp)
        total = ctx.quantity(c.get("value"), f"{cp}.value")
        policy = None
        if c.get("requestPolicy") is not None:
            policy = _policy(ctx, f"{cp}.requestPolicy", c["requestPolicy"])
        q = qualify(str(key), driver)
        # An entry qualified with the driver's own domain wins over the unqualified one.
        if q in caps and "/" not in str(key):
            continue
        caps[q] = Capacity(str(key), total, policy)
    allow = d.get("allowMultipleAllocations", False)
    if not isinstance(allow, bool):
        raise ctx.fail(f"{path}.allowMultipleAllocations", f"{allow!r} is not a boolean")
    taints = []
    for i, raw_t in enumerate(ctx.seq(d.get("taints"), f"{path}.taints")):
        tp = f"{path}.taints[{i}]"
        t = ctx.mapping(raw_t, tp)
        taints.append(
            Taint(
                ctx.string(t.get("key"), f"{tp}.key"),
                str(t.get("value") or ""),
                ctx.string(t.get("effect"), f"{tp}.effect"),
            )
        )
    return Device(node, driver, pool, name, attrs, caps, allow, taints=tuple(taints))


def _policy(ctx: _Ctx, path: str, raw: Any) -> RequestPolicy:
    p = ctx.mapping(raw, path)
    default = (
        ctx.quantity(p["default"], f"{path}.default") if p.get("default") is not None else None
    )
    values = None
    if p.get("validValues") is not None:
        values = tuple(
            ctx.quantity(v, f"{path}.validValues[{i}]")
            for i, v in enumerate(ctx.seq(p["validValues"], f"{path}.validValues"))
        )
        if list(values) != sorted(set(values)):
            raise ctx.fail(f"{path}.validValues", "must be strictly ascending")
    vr = None
    if p.get("validRange") is not None:
        rp = f"{path}.validRange"
        r = ctx.mapping(p["validRange"], rp)
        if r.get("min") is None:
            raise ctx.fail(f"{rp}.min", "is required")
        lo = ctx.quantity(r["min"], f"{rp}.min")
        hi = ctx.quantity(r["max"], f"{rp}.max") if r.get("max") is not None else None
        step = ctx.quantity(r["step"], f"{rp}.step") if r.get("step") is not None else None
        if step is not None and step <= 0:
            raise ctx.fail(f"{rp}.step", "must be more than zero")
        vr = ValidRange(lo, hi, step)
    if values is not None and vr is not None:
        raise ctx.fail(path, "validValues and validRange are mutually exclusive")
    return RequestPolicy(default, values, vr)


def parse_device_class(ctx: _Ctx, prefix: str, obj: dict[str, Any]) -> DeviceClass:
    meta = ctx.mapping(obj.get("metadata"), _join(prefix, "metadata"))
    name = ctx.string(meta.get("name"), _join(prefix, "metadata.name"))
    spec = ctx.mapping(obj.get("spec") or {}, _join(prefix, "spec"))
    sp = _join(prefix, "spec.selectors")
    return DeviceClass(name, _selectors(ctx, sp, spec.get("selectors")), str(ctx.file), sp)


def _selectors(ctx: _Ctx, path: str, raw: Any) -> tuple[str, ...]:
    out = []
    for i, s in enumerate(ctx.seq(raw, path)):
        sel = ctx.fields(s, f"{path}[{i}]", ("cel",))
        cel = ctx.fields(sel.get("cel"), f"{path}[{i}].cel", ("expression",))
        out.append(ctx.string(cel.get("expression"), f"{path}[{i}].cel.expression"))
    return tuple(out)


_DEVICE_REQUEST_FIELDS = (
    "name",
    "deviceClassName",
    "selectors",
    "allocationMode",
    "count",
    "adminAccess",
    "capacity",
    "tolerations",
)


def _device_request(ctx: _Ctx, path: str, raw: Any, name: str) -> DeviceRequest:
    r = ctx.fields(raw, path, _DEVICE_REQUEST_FIELDS)
    mode = r.get("allocationMode", "ExactCount")
    if mode not in ("ExactCount", "All"):
        raise ctx.fail(
            f"{path}.allocationMode", f"{mode!r} is not allowed; allowed: ExactCount, All"
        )
    count = ctx.integer(r.get("count", 1), f"{path}.count", 1)
    if mode == "All" and "count" in r:
        raise ctx.fail(f"{path}.count", "must not be set with allocationMode All")
    caps: list[tuple[str, Decimal]] = []
    capacity = ctx.fields(r.get("capacity") or {}, f"{path}.capacity", ("requests",))
    for key, value in ctx.mapping(
        capacity.get("requests") or {}, f"{path}.capacity.requests"
    ).items():
        caps.append((str(key), ctx.quantity(value, f"{path}.capacity.requests.{key}")))
    tolerations = []
    for i, raw_t in enumerate(ctx.seq(r.get("tolerations"), f"{path}.tolerations")):
        tp = f"{path}.tolerations[{i}]"
        t = ctx.fields(raw_t, tp, ("key", "operator", "value", "effect", "tolerationSeconds"))
        op = t.get("operator", "Equal")
        if op not in ("Equal", "Exists"):
            raise ctx.fail(f"{tp}.operator", f"{op!r} is not allowed; allowed: Equal, Exists")
        tolerations.append(
            Toleration(
                str(t.get("key") or ""), op, str(t.get("value") or ""), str(t.get("effect") or "")
            )
        )
    return DeviceRequest(
        name=name,
        device_class=ctx.string(r.get("deviceClassName"), f"{path}.deviceClassName"),
        selectors=_selectors(ctx, f"{path}.selectors", r.get("selectors")),
        mode=cast(Any, mode),
        count=count,
        capacity=tuple(caps),
        tolerations=tuple(tolerations),
    )


def parse_claim_spec(ctx: _Ctx, path: str, raw: Any) -> ClaimSpec:
    spec = ctx.fields(raw, path, ("devices",))
    devices = ctx.fields(
        spec.get("devices"), f"{path}.devices", ("requests", "constraints", "config")
    )
    requests: list[Request] = []
    seen: set[str] = set()
    reqs = ctx.items(devices.get("requests"), f"{path}.devices.requests", "request")
    for i, raw_req in enumerate(reqs):
        rp = f"{path}.devices.requests[{i}]"
        r = ctx.fields(raw_req, rp, ("name", "exactly", "firstAvailable"))
        name = ctx.unique_name(r, rp, seen, "request")
        if (r.get("exactly") is None) == (r.get("firstAvailable") is None):
            raise ctx.fail(rp, "must have exactly one of exactly, firstAvailable")
        if r.get("exactly") is not None:
            alts: tuple[DeviceRequest, ...] = (
                _device_request(ctx, f"{rp}.exactly", r["exactly"], name),
            )
        else:
            subs = ctx.items(r["firstAvailable"], f"{rp}.firstAvailable", "subrequest")
            sub_names: set[str] = set()
            alts = tuple(
                _device_request(
                    ctx,
                    f"{rp}.firstAvailable[{j}]",
                    sub,
                    f"{name}/{ctx.unique_name(ctx.mapping(sub, f'{rp}.firstAvailable[{j}]'), f'{rp}.firstAvailable[{j}]', sub_names, 'subrequest')}",
                )
                for j, sub in enumerate(subs)
            )
        requests.append(Request(name, alts))
    constraints: list[Constraint] = []
    for i, raw_c in enumerate(ctx.seq(devices.get("constraints"), f"{path}.devices.constraints")):
        cp = f"{path}.devices.constraints[{i}]"
        c = ctx.fields(raw_c, cp, ("requests", "matchAttribute", "distinctAttribute"))
        names = tuple(str(n) for n in ctx.seq(c.get("requests"), f"{cp}.requests"))
        for n in names:
            if n.split("/")[0] not in seen:
                raise ctx.fail(f"{cp}.requests", f"{n!r} is not a request of this claim")
        match, distinct = c.get("matchAttribute"), c.get("distinctAttribute")
        if (match is None) == (distinct is None):
            raise ctx.fail(cp, "must have exactly one of matchAttribute, distinctAttribute")
        attr = ctx.string(
            match or distinct, f"{cp}.{'matchAttribute' if match else 'distinctAttribute'}"
        )
        if "/" not in attr:
            raise ctx.fail(
                f"{cp}.{'matchAttribute' if match else 'distinctAttribute'}",
                f"{attr!r} must be fully qualified (<domain>/<name>)",
            )
        constraints.append(Constraint(names, attr if match else None, attr if distinct else None))
    return ClaimSpec(tuple(requests), tuple(constraints), _burst(ctx, path, devices, seen))


_RATIO = re.compile(r"([0-9]{1,6}(?:\.[0-9]{1,6})?)x")


def _burst(
    ctx: _Ctx, path: str, devices: dict[str, Any], requests: set[str]
) -> tuple[tuple[str, BurstLimit], ...]:
    """The `memoryLimit` of each VgpuConfig among the claim's configs (the driver's opaque
    parameters; other configs and fields are not the plan's to judge)."""
    out: list[tuple[str, BurstLimit]] = []
    for i, entry in enumerate(ctx.seq(devices.get("config"), f"{path}.devices.config")):
        opaque = entry.get("opaque") if isinstance(entry, dict) else None
        params = opaque.get("parameters") if isinstance(opaque, dict) else None
        if not isinstance(params, dict) or params.get("kind") != "VgpuConfig":
            continue
        raw = params.get("memoryLimit")
        if raw is None:
            continue
        where = f"{path}.devices.config[{i}].opaque.parameters.memoryLimit"
        if isinstance(raw, str) and (m := _RATIO.fullmatch(raw.strip())):
            ratio = Decimal(m.group(1))
            if ratio < 1:
                raise ctx.fail(where, f"{raw!r} is below the request; allowed: 1x or more")
            limit = BurstLimit(raw, ratio=ratio)
        else:
            if isinstance(raw, bool) or not isinstance(raw, str | int):
                raise ctx.fail(where, f"{raw!r} invalid; allowed: a quantity, or <r>x")
            try:
                limit = BurstLimit(str(raw), nbytes=parse_bytes(raw, where))
            except QuantityError as e:
                raise InputError(ctx.file, "", str(e)) from None
        names = [str(n) for n in entry.get("requests") or []] or [""]
        for n in names:
            if n and n.split("/")[0] not in requests:
                raise ctx.fail(f"{path}.devices.config[{i}].requests", f"{n!r} is not a request "
                               "of this claim")  # fmt: skip
            out.append((n, limit))
    return tuple(out)


def load_workloads(file: Path) -> tuple[list[Workload], dict[str, DeviceClass]]:
    ctx = _Ctx(file)
    docs = list(_documents(file))
    if len(docs) != 1:
        raise ctx.fail("", "must hold one document: {workloads: [...], deviceClasses: [...]}")
    top = ctx.fields(docs[0][1], "(document)", ("workloads", "deviceClasses"))
    workloads: list[Workload] = []
    names: set[str] = set()
    for i, raw in enumerate(ctx.items(top.get("workloads"), "workloads", "workload")):
        wp = f"workloads[{i}]"
        w = ctx.fields(raw, wp, ("name", "replicas", "spec"))
        name = ctx.unique_name(w, wp, names, "workload")
        replicas = ctx.integer(w.get("replicas", 1), f"{wp}.replicas", 0)
        workloads.append(
            Workload(name, replicas, parse_claim_spec(ctx, f"{wp}.spec", w.get("spec")))
        )
    classes: dict[str, DeviceClass] = {}
    for i, raw in enumerate(ctx.seq(top.get("deviceClasses"), "deviceClasses")):
        dc = parse_device_class(ctx, f"deviceClasses[{i}]", ctx.mapping(raw, f"deviceClasses[{i}]"))
        classes[dc.name] = dc
    return workloads, classes

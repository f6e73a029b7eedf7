"""A typed model of a CDI (Container Device Interface) spec and its minimum cdiVersion.

Only the parts of the spec this project writes are modelled: env, device nodes, mounts, hooks
and annotations. `Spec.to_dict()` produces the JSON document; `minimum_version()` computes the
lowest `cdiVersion` that expresses the features used, because runtimes reject versions they do
not know (Debian 12's podman 4.3 knows up to 0.5.0) and reject specs that use features newer
than they declare.

Version rules (from the CDI project's own `MinimumRequiredVersion`):
  0.3.0  the base: env, device nodes (path only), mounts without a type, hooks
  0.4.0  a mount `type`
  0.5.0  a device node `hostPath`; a device name that does not start with a letter
  0.6.0  annotations (spec or device level); a '.' in the class part of the kind
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Ordered oldest to newest; only versions this module can select.
KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0")

_VENDOR_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?$")
_CLASS_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.\-]*[A-Za-z0-9])?$")
_DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:\-]*[A-Za-z0-9])?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HOOK_NAMES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart",
               "poststop")  # fmt: skip


class SpecError(ValueError):
    """A spec that CDI consumers would reject. str() is one line naming the field."""


@dataclass(frozen=True)
class DeviceNode:
    path: str
    host_path: str | None = None
    type: str | None = None  # "c" | "b"
    major: int | None = None
    minor: int | None = None
    permissions: str | None = None  # e.g. "rw"
    uid: int | None = None
    gid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path}
        for key, value in (
            ("hostPath", self.host_path),
            ("type", self.type),
            ("major", self.major),
            ("minor", self.minor),
            ("permissions", self.permissions),
            ("uid", self.uid),
            ("gid", self.gid),
        ):
            if value is not None:
                d[key] = value
        return d


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"hostPath": self.host_path, "containerPath": self.container_path}
        if self.options:
            d["options"] = list(self.options)
        if self.type is not None:
            d["type"] = self.type
        return d


@dataclass(frozen=True)
class Hook:
    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"hookName": self.hook_name, "path": self.path}
        if self.args:
            d["args"] = list(self.args)
        if self.env:
            d["env"] = list(self.env)
        if self.timeout is not None:
            d["timeout"] = self.timeout
        return d


@dataclass(frozen=True)
class ContainerEdits:
    env: tuple[tuple[str, str], ...] = ()  # ordered (name, value) pairs
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()

    def is_empty(self) -> bool:
        return not (self.env or self.device_nodes or self.mounts or self.hooks)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.env:
            d["env"] = [f"{k}={v}" for k, v in self.env]
        if self.device_nodes:
            d["deviceNodes"] = [n.to_dict() for n in self.device_nodes]
        if self.mounts:
            d["mounts"] = [m.to_dict() for m in self.mounts]
        if self.hooks:
            d["hooks"] = [h.to_dict() for h in self.hooks]
        return d


@dataclass(frozen=True)
class Device:
    name: str
    edits: ContainerEdits
    annotations: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name}
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        d["containerEdits"] = self.edits.to_dict()
        return d


@dataclass(frozen=True)
class Spec:
    """One CDI spec file: a kind (`vendor/class`) and its devices."""

    kind: str
    devices: tuple[Device, ...]
    edits: ContainerEdits = ContainerEdits()
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def vendor(self) -> str:
        return self.kind.split("/", 1)[0]

    @property
    def device_class(self) -> str:
        return self.kind.split("/", 1)[1]

    def qualified_name(self, device: str) -> str:
        """The id a runtime is given: `vendor/class=name`."""
        return f"{self.kind}={device}"

    def check(self) -> None:
        """Raise SpecError for what the schema cannot express but CDI consumers enforce."""
        if self.kind.count("/") != 1:
            raise SpecError(f"kind {self.kind!r}: must be 'vendor/class' with exactly one '/'")
        if not _VENDOR_RE.match(self.vendor):
            raise SpecError(
                f"kind {self.kind!r}: vendor {self.vendor!r} must be letters, digits, '.', '-'"
            )
        if not _CLASS_RE.match(self.device_class):
            raise SpecError(
                f"kind {self.kind!r}: class {self.device_class!r} must be letters, digits, "
                "'_', '.', '-'"
            )
        if not self.devices:
            raise SpecError(f"kind {self.kind!r}: a spec needs at least one device")
        seen: set[str] = set()
        for dev in self.devices:
            if not _DEVICE_NAME_RE.match(dev.name):
                raise SpecError(
                    f"device {dev.name!r}: a name is letters, digits, '_', '.', ':', '-' and "
                    "starts and ends with a letter or digit"
                )
            if dev.name in seen:
                raise SpecError(f"device {dev.name!r}: appears twice")
            seen.add(dev.name)
        for where, edits in self._all_edits():
            for name, _ in edits.env:
                if not _ENV_NAME_RE.match(name):
                    raise SpecError(f"{where}: env name {name!r} is not a valid variable name")
            for node in edits.device_nodes:
                if not node.path.startswith("/"):
                    raise SpecError(f"{where}: device node path {node.path!r} is not absolute")
            for mount in edits.mounts:
                for p in (mount.host_path, mount.container_path):
                    if not p.startswith("/"):
                        raise SpecError(f"{where}: mount path {p!r} is not absolute")
            for hook in edits.hooks:
                if hook.hook_name not in _HOOK_NAMES:
                    raise SpecError(
                        f"{where}: hook {hook.hook_name!r} unknown; "
                        f"allowed: {', '.join(_HOOK_NAMES)}"
                    )

    def _all_edits(self) -> list[tuple[str, ContainerEdits]]:
        edits = [(f"device {d.name!r}", d.edits) for d in self.devices]
        edits.append(("spec", self.edits))
        return edits

    def minimum_version(self) -> str:
        """The lowest cdiVersion that expresses every feature this spec uses."""
        if self.annotations or any(d.annotations for d in self.devices):
            return "0.6.0"
        if "." in self.device_class:
            return "0.6.0"
        all_edits = [e for _, e in self._all_edits()]
        if any(n.host_path for e in all_edits for n in e.device_nodes):
            return "0.5.0"
        if any(not d.name[:1].isalpha() for d in self.devices):
            return "0.5.0"
        if any(m.type for e in all_edits for m in e.mounts):
            return "0.4.0"
        return "0.3.0"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"cdiVersion": self.minimum_version(), "kind": self.kind}
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        d["devices"] = [dev.to_dict() for dev in self.devices]
        if not self.edits.is_empty():
            d["containerEdits"] = self.edits.to_dict()
        return d


_SPEC_SUFFIX = ".json"


def transient_spec_prefix(kind: str) -> str:
    """What every per-claim spec file name of `kind` starts with: `<vendor>-<class>_`."""
    vendor, _, klass = kind.partition("/")
    return f"{vendor}-{klass}_"


def transient_spec_name(kind: str, uid: str) -> str:
    """The file name of a per-claim ("transient") spec: `<vendor>-<class>_<uid>.json`."""
    return f"{transient_spec_prefix(kind)}{uid}{_SPEC_SUFFIX}"


def transient_spec_uid(kind: str, name: str) -> str | None:
    """The claim UID whose spec of `kind` has the file name `name` (transient_spec_name's
    inverse), or None when `name` is not such a name."""
    prefix = transient_spec_prefix(kind)
    if name.startswith(prefix) and name.endswith(_SPEC_SUFFIX):
        return name[len(prefix) : -len(_SPEC_SUFFIX)]
    return None

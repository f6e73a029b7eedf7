"""Validation of CDI spec documents against the official JSON schema (vendored in cdi/schema/)."""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from cdi.spec import KNOWN_VERSIONS


class SchemaError(ValueError):
    """A document the official CDI schema rejects. str() is one line: where and why."""


def _load(name: str) -> dict[str, Any]:
    text = resources.files("cdi").joinpath("schema", name).read_text(encoding="utf-8")
    doc: dict[str, Any] = json.loads(text)
    return doc


@functools.cache
def _validator() -> Any:
    # schema.json refers to "defs.json#/definitions/..." by relative URI: register defs.json
    # under that name so nothing is fetched over the network.
    schema = _load("schema.json")
    defs = Resource.from_contents(_load("defs.json"), default_specification=DRAFT7)
    registry: Registry[Any] = Registry().with_resource("defs.json", defs)
    return jsonschema.Draft7Validator(schema, registry=registry)


def validate(doc: dict[str, Any]) -> None:
    """Raise SchemaError unless `doc` is a valid CDI spec this project may write.

    Besides the schema, the env entries must be "NAME=value" strings (the schema's own rule for
    them is mistyped upstream and checks nothing) and cdiVersion must be one we know.
    """
    errors = sorted(_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = "/".join(str(p) for p in e.absolute_path) or "(document)"
        raise SchemaError(f"CDI spec invalid at {where}: {e.message}")
    version = doc.get("cdiVersion")
    if version not in KNOWN_VERSIONS:
        raise SchemaError(
            f"CDI spec cdiVersion {version!r} unknown; allowed: {', '.join(KNOWN_VERSIONS)}"
        )
    edit_sets = [doc.get("containerEdits") or {}]
    edit_sets += [d.get("containerEdits") or {} for d in doc.get("devices", [])]
    for edits in edit_sets:
        for entry in edits.get("env", []):
            if not isinstance(entry, str) or "=" not in entry:
                raise SchemaError(f"CDI spec env entry {entry!r} is not a 'NAME=value' string")

"""YAML (and JSON) documents into Python objects, fast, with PyYAML's safe_load meaning.

`kubectl get resourceslices -o yaml` of a large cluster is tens of megabytes; PyYAML's
constructor layer (Python) costs four times what libyaml's parser does. This builds the
objects straight from the parser's events, resolving plain scalars with PyYAML's own
resolver and safe constructors, and falls back to yaml.load_all for anything it does not
handle itself (anchors, aliases, explicit tags, merge keys, timestamps...).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import yaml

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_RESOLVER = yaml.resolver.Resolver()
_SAFE = yaml.constructor.SafeConstructor()
_STR = "tag:yaml.org,2002:str"
# First characters for which some implicit type exists; any other plain scalar is a string.
_IMPLICIT_FIRST = frozenset(k for k in _RESOLVER.yaml_implicit_resolvers if k)
_CONSTRUCT: dict[str, Callable[[yaml.ScalarNode], Any]] = {
    "tag:yaml.org,2002:int": _SAFE.construct_yaml_int,
    "tag:yaml.org,2002:float": _SAFE.construct_yaml_float,
    "tag:yaml.org,2002:bool": _SAFE.construct_yaml_bool,
    "tag:yaml.org,2002:null": _SAFE.construct_yaml_null,
}


class _Fallback(Exception):
    pass


def _scalar(ev: Any) -> Any:
    if ev.anchor is not None or (ev.tag is not None and ev.tag != "!"):
        raise _Fallback
    if ev.style:  # quoted or block: always a string
        return ev.value
    value = ev.value
    if value and value[0] not in _IMPLICIT_FIRST and value != "<<":
        return value
    tag = _RESOLVER.resolve(yaml.ScalarNode, ev.value, (True, False))  # type: ignore[no-untyped-call]
    if tag == _STR:
        if ev.value == "<<":
            raise _Fallback  # a merge key
        return ev.value
    construct = _CONSTRUCT.get(tag)
    if construct is None:
        raise _Fallback
    return construct(yaml.ScalarNode(tag, ev.value))


def _from_events(text: str) -> list[Any]:
    docs: list[Any] = []
    stack: list[Any] = []
    keys: list[Any] = []
    pending = False  # a document has started and has no root yet
    mark = object()  # "no key yet" in keys

    def put(value: Any) -> None:
        nonlocal pending
        if not stack:
            docs.append(value)
            pending = False
            return
        top = stack[-1]
        if type(top) is list:
            top.append(value)
        elif keys[-1] is mark:
            if isinstance(value, (dict, list)):
                raise _Fallback  # a complex key
            keys[-1] = value
        else:
            top[keys[-1]] = value
            keys[-1] = mark

    ev: Any
    for ev in yaml.parse(text, Loader=_Loader):
        kind = type(ev)
        if kind is yaml.ScalarEvent:
            put(_scalar(ev))
        elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            if ev.anchor is not None or (ev.tag is not None and not ev.implicit):
                raise _Fallback
            node: Any = {} if kind is yaml.MappingStartEvent else []
            put(node)
            stack.append(node)
            keys.append(mark)
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            stack.pop()
            keys.pop()
        elif kind is yaml.DocumentStartEvent:
            pending = True
        elif kind is yaml.DocumentEndEvent:
            if pending:
                docs.append(None)
                pending = False
        elif kind is yaml.AliasEvent:
            raise _Fallback
    return docs


def load_all(text: str) -> list[Any]:
    """Every document of the text, as yaml.safe_load_all gives them. Raises yaml.YAMLError."""
    if text.lstrip()[:1] in ("{", "["):
        # JSON (`kubectl get -o json`) is YAML too, and json reads it ten times faster.
        try:
            return [json.loads(text)]
        except ValueError:
            pass  # flow-style YAML, or not valid JSON: YAML says which
    try:
        return _from_events(text)
    except _Fallback:
        return list(yaml.load_all(text, Loader=_Loader))

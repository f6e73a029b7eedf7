"""Evaluating Kubernetes CEL (DRA device selectors, ValidatingAdmissionPolicy) with a real CEL
implementation (cel-python), plus the Kubernetes library functions our manifests use:
`quantity()` with `compareTo`/`isGreaterThan`/`isLessThan`/`asInteger`, and `semver()` with
`compareTo` (version attributes).

Devices are presented as the scheduler presents them: `device.driver`,
`device.attributes["<domain>"].<name>`, `device.capacity["<domain>"].<name>` (a quantity);
an attribute name without a domain is in the driver's domain.
"""

from __future__ import annotations

from fractions import Fraction
from functools import total_ordering
from typing import Any

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

from tests.fakes.apiserver import parse_quantity


@total_ordering
class Quantity:
    def __init__(self, value: Fraction) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Quantity) and self.value == other.value

    def __lt__(self, other: Quantity) -> bool:
        return self.value < other.value

    def __hash__(self) -> int:
        return hash(self.value)


@total_ordering
class Semver:
    def __init__(self, text: str) -> None:
        self.parts = tuple(int(p) for p in text.split("-")[0].split("."))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Semver) and self.parts == other.parts

    def __lt__(self, other: Semver) -> bool:
        return self.parts < other.parts

    def __hash__(self) -> int:
        return hash(self.parts)


def _compare(a: Any, b: Any) -> celtypes.IntType:
    return celtypes.IntType((a > b) - (a < b))


FUNCTIONS: dict[str, Any] = {
    "quantity": lambda s: Quantity(parse_quantity(str(s))),
    "semver": lambda s: Semver(str(s)),
    "compareTo": _compare,
    "isGreaterThan": lambda a, b: celtypes.BoolType(a > b),
    "isLessThan": lambda a, b: celtypes.BoolType(a < b),
    "asInteger": lambda q: celtypes.IntType(int(q.value)),
}


def compile_expression(expression: str) -> Any:
    """A runnable program; raises celpy.CELParseError on a syntax error."""
    env = celpy.Environment()
    return env.program(env.compile(expression), functions=FUNCTIONS)


def _attribute(value: dict[str, Any]) -> Any:
    [(kind, v)] = value.items()
    if kind == "int":
        return celtypes.IntType(v)
    if kind == "bool":
        return celtypes.BoolType(v)
    if kind == "string":
        return celtypes.StringType(v)
    if kind == "version":
        return Semver(v)
    raise ValueError(f"unknown attribute kind {kind}")


def _split(name: str, driver: str) -> tuple[str, str]:
    if "/" in name:
        domain, short = name.rsplit("/", 1)
        return domain, short
    return driver, name


def device_activation(driver: str, device: dict[str, Any]) -> dict[str, Any]:
    attrs: dict[str, dict[str, Any]] = {}
    for name, value in (device.get("attributes") or {}).items():
        domain, short = _split(name, driver)
        attrs.setdefault(domain, {})[short] = _attribute(value)
    caps: dict[str, dict[str, Any]] = {}
    for name, cap in (device.get("capacity") or {}).items():
        domain, short = _split(name, driver)
        caps.setdefault(domain, {})[short] = Quantity(parse_quantity(cap["value"]))
    return {
        "device": celtypes.MapType(
            {
                celtypes.StringType("driver"): celtypes.StringType(driver),
                celtypes.StringType("attributes"): _map(attrs),
                celtypes.StringType("capacity"): _map(caps),
            }
        )
    }


def _map(d: dict[str, dict[str, Any]]) -> celtypes.MapType:
    return celtypes.MapType(
        {
            celtypes.StringType(k): celtypes.MapType(
                {celtypes.StringType(n): v for n, v in inner.items()}
            )
            for k, inner in d.items()
        }
    )


def selects(expressions: list[str], driver: str, device: dict[str, Any]) -> bool:
    """True if every expression is true for the device (an evaluation error is not a match, as
    the scheduler treats it for this device)."""
    activation = device_activation(driver, device)
    for e in expressions:
        result = compile_expression(e).evaluate(activation)
        if isinstance(result, CELEvalError):
            return False
        if not isinstance(result, celtypes.BoolType):
            raise TypeError(f"{e!r} gave {result!r}, not a bool")
        if not result:
            return False
    return True


def evaluate(expression: str, activation: dict[str, Any]) -> Any:
    """The expression's value on plain JSON-like data (objects are converted to CEL)."""
    cel = {k: json_to_cel(v) for k, v in activation.items() if k != "variables"}
    if "variables" in activation:
        cel["variables"] = celtypes.MapType(
            {celtypes.StringType(k): v for k, v in activation["variables"].items()}
        )
    return compile_expression(expression).evaluate(cel)

"""Device selectors (DeviceClass and request `selectors[].cel.expression`) through celpy.

celpy (PyPI `cel-python`) is a complete CEL implementation; this module adds what Kubernetes
adds for DRA:
  * the `device` variable: `device.driver`, `device.allowMultipleAllocations`,
    `device.attributes["<domain>"].<name>` and `device.capacity["<domain>"].<name>`
    (an unqualified name belongs to the driver's domain);
  * the quantity library: `quantity("4Gi")`, `isQuantity()`, and the methods
    `compareTo`, `isLessThan`, `isGreaterThan`, `add`, `sub`, `asInteger`,
    `asApproximateFloat`, `isInteger`, `sign` with Kubernetes' exact-value semantics;
  * the semver library: `semver("1.2.3")`, `isSemver()`, `major`, `minor`, `patch`,
    `compareTo`, `isLessThan`, `isGreaterThan` (version attributes are semver values).

`evaluate()` runs one expression over arbitrary variables with the same functions, e.g. a
ValidatingAdmissionPolicy's `object`, `oldObject`, `request` and `variables`.

A selector's result depends only on the device, never on what is allocated, so results are
cached. Many devices look the same to an expression (eight GPUs of one model differ only in
uuid and index): the cache key is the part of the device the expression can read, found from
the names it mentions, so a thousand identical GPUs cost one evaluation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import total_ordering
from typing import Any

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError

from sharing.kubequantity import KubeQuantityError as QuantityError
from sharing.kubequantity import parse
from sharing.plan.model import AttrValue, Device

MAX_INT64 = 2**63 - 1


class CelError(ValueError):
    """An expression that does not compile. str() is one line."""


@total_ordering
class Quantity:
    """A CEL value of Kubernetes' Quantity type; compares and prints by exact value."""

    __slots__ = ("value",)

    def __init__(self, value: Decimal) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Quantity) and self.value == other.value

    def __lt__(self, other: Quantity) -> bool:
        return self.value < other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"quantity({self.value})"


_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


@total_ordering
class Semver:
    """A CEL value of the semver type: ordered by semver 2.0 precedence (build ignored)."""

    __slots__ = ("major", "minor", "patch", "pre", "text")

    def __init__(self, text: str) -> None:
        m = _SEMVER.match(text)
        if not m:
            raise ValueError(f"{text!r} is not a semantic version")
        self.text = text
        self.major, self.minor, self.patch = int(m.group(1)), int(m.group(2)), int(m.group(3))
        self.pre: tuple[str, ...] = tuple(m.group(4).split(".")) if m.group(4) else ()

    def _key(self) -> tuple[Any, ...]:
        # A release sorts after its pre-releases; numeric identifiers sort before others.
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.pre)
        return (self.major, self.minor, self.patch, not self.pre, pre)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Semver) and self._key() == other._key()

    def __lt__(self, other: Semver) -> bool:
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"semver({self.text})"


def _quantity(text: Any) -> Quantity:
    try:
        return Quantity(parse(str(text)))
    except QuantityError as e:
        raise ValueError(str(e)) from None


def _is_quantity(text: Any) -> celtypes.BoolType:
    try:
        parse(str(text))
    except QuantityError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _semver(text: Any, normalize: Any = False) -> Semver:
    s = str(text)
    if normalize:
        s = s.removeprefix("v")
        core, sep, rest = s.partition("-") if "-" in s else s.partition("+")
        parts = core.split(".")
        if all(p.isdigit() for p in parts) and 1 <= len(parts) <= 3:
            core = ".".join(str(int(p)) for p in parts + ["0"] * (3 - len(parts)))
        s = core + sep + rest
    return Semver(s)


def _is_semver(text: Any, normalize: Any = False) -> celtypes.BoolType:
    try:
        _semver(text, normalize)
    except ValueError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _same_type(a: Any, b: Any) -> None:
    if not (
        (isinstance(a, Quantity) and isinstance(b, Quantity))
        or (isinstance(a, Semver) and isinstance(b, Semver))
    ):
        raise TypeError(f"no such overload for {type(a).__name__} and {type(b).__name__}")


def _compare_to(a: Any, b: Any) -> celtypes.IntType:
    _same_type(a, b)
    return celtypes.IntType((a > b) - (a < b))


def _less(a: Any, b: Any) -> celtypes.BoolType:
    _same_type(a, b)
    return celtypes.BoolType(a < b)


def _greater(a: Any, b: Any) -> celtypes.BoolType:
    _same_type(a, b)
    return celtypes.BoolType(a > b)


def _operand(b: Any) -> Decimal:
    if isinstance(b, Quantity):
        return b.value
    if isinstance(b, int) and not isinstance(b, bool):
        return Decimal(int(b))
    raise TypeError(f"no such overload for quantity and {type(b).__name__}")


def _add(a: Any, b: Any) -> Quantity:
    if not isinstance(a, Quantity):
        raise TypeError("add() needs a quantity")
    return Quantity(a.value + _operand(b))


def _sub(a: Any, b: Any) -> Quantity:
    if not isinstance(a, Quantity):
        raise TypeError("sub() needs a quantity")
    return Quantity(a.value - _operand(b))


def _as_integer(a: Any) -> celtypes.IntType:
    if not isinstance(a, Quantity):
        raise TypeError("asInteger() needs a quantity")
    if a.value != a.value.to_integral_value() or abs(a.value) > MAX_INT64:
        raise ValueError(f"cannot convert quantity {a.value} to an integer")
    return celtypes.IntType(int(a.value))


def _as_float(a: Any) -> celtypes.DoubleType:
    if not isinstance(a, Quantity):
        raise TypeError("asApproximateFloat() needs a quantity")
    return celtypes.DoubleType(float(a.value))


def _is_integer(a: Any) -> celtypes.BoolType:
    if not isinstance(a, Quantity):
        raise TypeError("isInteger() needs a quantity")
    return celtypes.BoolType(a.value == a.value.to_integral_value() and abs(a.value) <= MAX_INT64)


def _sign(a: Any) -> celtypes.IntType:
    if not isinstance(a, Quantity):
        raise TypeError("sign() needs a quantity")
    return celtypes.IntType((a.value > 0) - (a.value < 0))


def _version_part(name: str) -> Any:
    def get(a: Any) -> celtypes.IntType:
        if not isinstance(a, Semver):
            raise TypeError(f"{name}() needs a semver")
        return celtypes.IntType(getattr(a, name))

    return get


def _string(name: str, fn: Any) -> Any:
    """A method of Kubernetes' CEL strings library (cel-go ext.Strings) on a string target."""

    def method(target: Any, *args: Any) -> Any:
        if not isinstance(target, str):
            raise TypeError(f"{name}() needs a string")
        return fn(str(target), *args)

    return method


def _split_text(text: str, sep: Any, limit: Any = -1) -> celtypes.ListType:
    n = int(limit)
    if n == 0:
        return celtypes.ListType([])
    parts = text.split(str(sep)) if n < 0 else text.split(str(sep), n - 1)
    return celtypes.ListType([celtypes.StringType(p) for p in parts])


def _join(items: Any, sep: Any = "") -> celtypes.StringType:
    if not isinstance(items, list):
        raise TypeError("join() needs a list of strings")
    return celtypes.StringType(str(sep).join(str(i) for i in items))


STRING_FUNCTIONS: dict[str, Any] = {
    "lowerAscii": _string("lowerAscii", lambda t: celtypes.StringType(t.lower())),
    "upperAscii": _string("upperAscii", lambda t: celtypes.StringType(t.upper())),
    "trim": _string("trim", lambda t: celtypes.StringType(t.strip())),
    "indexOf": _string("indexOf", lambda t, x: celtypes.IntType(t.find(str(x)))),
    "lastIndexOf": _string("lastIndexOf", lambda t, x: celtypes.IntType(t.rfind(str(x)))),
    "replace": _string(
        "replace", lambda t, a, b, n=-1: celtypes.StringType(t.replace(str(a), str(b), int(n)))
    ),
    "split": _string("split", _split_text),
    "join": _join,
}

FUNCTIONS: dict[str, Any] = {
    **STRING_FUNCTIONS,
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "semver": _semver,
    "isSemver": _is_semver,
    "compareTo": _compare_to,
    "isLessThan": _less,
    "isGreaterThan": _greater,
    "add": _add,
    "sub": _sub,
    "asInteger": _as_integer,
    "asApproximateFloat": _as_float,
    "isInteger": _is_integer,
    "sign": _sign,
    "major": _version_part("major"),
    "minor": _version_part("minor"),
    "patch": _version_part("patch"),
}


def _attr_to_cel(value: AttrValue) -> Any:
    kind, v = value
    if kind == "int":
        return celtypes.IntType(int(v))
    if kind == "bool":
        return celtypes.BoolType(bool(v))
    if kind == "version":
        return Semver(str(v))
    return celtypes.StringType(str(v))


def _split(qualified: str) -> tuple[str, str]:
    domain, _, name = qualified.rpartition("/")
    return domain, name


class _DomainMap(celtypes.MapType):
    """`device.attributes` / `device.capacity`: a domain the device lacks reads as an empty
    map, as in Kubernetes (`"x" in device.attributes["other.io"]` is false, not an error)."""

    def __getitem__(self, key: Any) -> Any:
        if key not in self:
            return celtypes.MapType({})
        return super().__getitem__(key)


def device_activation(device: Device) -> dict[str, Any]:
    """The `device` variable as the Kubernetes CEL environment defines it."""
    attrs: dict[str, dict[str, Any]] = {}
    for qualified, value in device.attributes.items():
        domain, name = _split(qualified)
        attrs.setdefault(domain, {})[name] = _attr_to_cel(value)
    caps: dict[str, dict[str, Any]] = {}
    for qualified, cap in device.capacity.items():
        domain, name = _split(qualified)
        caps.setdefault(domain, {})[name] = Quantity(cap.value)

    def cel_map(d: dict[str, dict[str, Any]]) -> celtypes.MapType:
        return _DomainMap(
            {
                celtypes.StringType(dom): celtypes.MapType(
                    {celtypes.StringType(k): v for k, v in inner.items()}
                )
                for dom, inner in d.items()
            }
        )

    return {
        "device": celtypes.MapType(
            {
                celtypes.StringType("driver"): celtypes.StringType(device.driver),
                celtypes.StringType("allowMultipleAllocations"): celtypes.BoolType(
                    device.allow_multiple
                ),
                celtypes.StringType("attributes"): cel_map(attrs),
                celtypes.StringType("capacity"): cel_map(caps),
            }
        )
    }


# Names an expression mentions (identifiers and string literals).
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|\'((?:[^\'\\]|\\.)*)\'|([A-Za-z_][A-Za-z0-9_]*)')
# A whole domain map used as a value (`"x" in device.attributes["d"]`, size(), ==, macros),
# or the attributes/capacity maps themselves: the expression may read any attribute.
_WHOLE_MAP = re.compile(
    r"""(attributes|capacity)\s*(\[\s*("[^"]*"|'[^']*')\s*\]\s*(?![\s.\[]*[.\[])|(?!\s*\[))"""
)
# An index that is not a plain string literal (`["uu" + "id"]`, `[device.driver]`) may name
# anything: key on the whole device.
_COMPUTED_INDEX = re.compile(r"""\[(?!\s*("[^"]*"|'[^']*')\s*\])""")
_MACROS = {"all", "exists", "exists_one", "map", "filter", "size"}


@dataclass(frozen=True)
class Selector:
    """One compiled expression and how to key its per-device cache."""

    expression: str
    program: Any
    names: frozenset[str] | None  # None: key on the whole device

    def key(self, device: Device) -> tuple[Any, ...]:
        if self.names is None:
            return (device.key,)
        names = self.names
        return (
            device.driver,
            device.allow_multiple,
            tuple((q, v) for q, v in device.attributes.items() if q.rpartition("/")[2] in names),
            tuple(
                (q, c.value) for q, c in device.capacity.items() if q.rpartition("/")[2] in names
            ),
        )


def _program(env: celpy.Environment, expression: str) -> Any:
    """The runnable program with the Kubernetes functions; CelError (one line) if it does not
    compile."""
    try:
        return env.program(env.compile(expression), functions=FUNCTIONS)
    except CELParseError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "syntax error"
        raise CelError(f"CEL expression does not compile: {first}") from None


class SelectorEvaluator:
    """Compiles each expression once and caches results per device (see the module doc)."""

    def __init__(self) -> None:
        self._env = celpy.Environment()
        self._compiled: dict[str, Selector] = {}
        self._results: dict[tuple[str, tuple[Any, ...]], bool | str] = {}
        self._activations: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.evaluations = 0  # CEL runs actually made (the rest came from the cache)

    def compile(self, expression: str) -> Selector:
        """The compiled selector; raises CelError (one line) when it does not compile."""
        got = self._compiled.get(expression)
        if got is not None:
            return got
        program = _program(self._env, expression)
        tokens: set[str] = set()
        for m in _TOKEN.finditer(expression):
            tokens.add(m.group(1) or m.group(2) or m.group(3) or "")
        whole = (
            bool(_WHOLE_MAP.search(expression))
            or bool(_COMPUTED_INDEX.search(expression))
            or bool(tokens & _MACROS)
        )
        sel = Selector(expression, program, None if whole else frozenset(tokens))
        self._compiled[expression] = sel
        return sel

    def matches(self, selector: Selector, device: Device) -> bool | str:
        """True/False, or the text of a CEL runtime error (the device then does not match)."""
        ck = (selector.expression, selector.key(device))
        got = self._results.get(ck)
        if got is not None:
            return got
        act = self._activations.get(device.key)
        if act is None:
            act = self._activations[device.key] = device_activation(device)
        self.evaluations += 1
        result: bool | str
        try:
            value = selector.program.evaluate(act)
        except Exception as e:  # any failure of one device's evaluation is that device's error
            result = _runtime_error(e)
        else:
            if isinstance(value, CELEvalError):
                result = _runtime_error(value)
            elif isinstance(value, celtypes.BoolType):
                result = bool(value)
            else:
                result = f"the expression gave {type(value).__name__}, not a bool"
        self._results[ck] = result
        return result


_ACTIVATION = re.compile(r" \(in (activation|container) .*", re.S)


def _runtime_error(e: BaseException) -> str:
    """One line. celpy's errors carry (message, exception type, the exception's args); its
    messages can quote the whole activation, which is cut off."""
    args = e.args
    text = str(args[0]) if args else type(e).__name__
    if len(args) >= 3 and isinstance(args[2], tuple) and args[2]:
        text = f"{text}: {args[2][0]}"
    text = _ACTIVATION.sub("", text)
    return f"CEL runtime error: {text.splitlines()[0] if text else type(e).__name__}"


def to_cel(value: Any) -> Any:
    """Plain JSON-like data (dicts, lists, str, int, float, bool, None) as CEL values. CEL values
    (an earlier evaluate() result, a quantity, a semver) are kept as they are."""
    if isinstance(value, Quantity | Semver) or type(value).__module__ == celtypes.__name__:
        return value
    if isinstance(value, Mapping):
        return celtypes.MapType({to_cel(k): to_cel(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return celtypes.ListType([to_cel(v) for v in value])
    return json_to_cel(value)


def evaluate(expression: str, variables: Mapping[str, Any]) -> Any:
    """The value of one expression with the given top-level variables (converted by to_cel).
    CelError (one line) when it does not compile or fails at run time."""
    program = _program(celpy.Environment(), expression)
    try:
        value = program.evaluate({k: to_cel(v) for k, v in variables.items()})
    except CELEvalError as e:
        raise CelError(_runtime_error(e)) from None
    if isinstance(value, CELEvalError):
        raise CelError(_runtime_error(value))
    return value

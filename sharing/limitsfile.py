"""The limits file of a plugin-prepared slice: the claim's limits, written by the plugin only.

The DRA plugin writes it at prepare (host `<data dir>/claims/<uid>/limits`, mode 0444, owned by
root) and mounts it read-only into the claim's containers at
`/usr/local/lib/vgpu-sharing/limits`. When the shim finds it, every limit comes from it and the
environment's limits and kill switches are ignored: the tenant owns its environment, not its
limits (docs/shim.md).

Format: text, one `KEY=VALUE` per line, `#` starts a comment line, blank lines ignored, no
quoting, no spaces around `=`. Keys are the env-contract names, values in the syntax the shim
accepts from the environment:

    CUDA_DEVICE_MEMORY_LIMIT_<i>=<bytes>        each container device index i (0..63)
    CUDA_DEVICE_SM_LIMIT_<i>=<percent>          0..100 (0 or 100 = no cap: sharing/percent.py)
    VGPU_COMPUTE_POLICY=hard|elastic|off
    CUDA_TASK_PRIORITY=<-100..100>
    VGPU_CONTEXT_RESERVE=<bytes>                (optional: the least charged per context; the
                                                shim charges what the driver reports, at least this)
    VGPU_CONTEXT_SIZE_<i>=<bytes>               (optional, per device index: what a context takes
                                                there, learned by the plugin for the GPU model; the
                                                slice's first process charges it before creating its
                                                context and verifies it against the driver)
    CUDA_DEVICE_MEMORY_SHARED_CACHE=<absolute path>
    VGPU_NODE_STATE_DIR=<absolute path>
    VGPU_DEMAND_FILE=<absolute path>

Every error is a LimitsFileError whose str() is one line naming the line, the key and what is
allowed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from sharing.percent import PercentError, parse_permille
from sharing.region import MAX_DEVICES  # device indices 0..MAX_DEVICES-1, as the shim's tables

POLICIES = ("hard", "elastic", "off")
PRIORITY_RANGE = (-100, 100)
MAX_PATH = 4095  # PATH_MAX - 1
MAX_FILE_BYTES = 64 * 1024  # far above any real file; a reader never slurps an unbounded one

MEMORY_KEY = "CUDA_DEVICE_MEMORY_LIMIT_"
SM_KEY = "CUDA_DEVICE_SM_LIMIT_"
CONTEXT_SIZE_KEY = "VGPU_CONTEXT_SIZE_"
_CONTEXT_SIZE_RE = re.compile(r"VGPU_CONTEXT_SIZE_(0|[1-9][0-9]?)")
PATH_KEYS = ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "VGPU_NODE_STATE_DIR", "VGPU_DEMAND_FILE")
_REQUIRED = ("VGPU_COMPUTE_POLICY", "CUDA_TASK_PRIORITY", "CUDA_DEVICE_MEMORY_SHARED_CACHE")

_INDEXED_RE = re.compile(r"(CUDA_DEVICE_MEMORY_LIMIT_|CUDA_DEVICE_SM_LIMIT_)(0|[1-9][0-9]?)")
_BYTES_RE = re.compile(r"0|[1-9][0-9]{0,19}")
_INT_RE = re.compile(r"-?(0|[1-9][0-9]{0,2})")


class LimitsFileError(ValueError):
    """A limits file (or the values for one) that cannot be used. str() is one line."""


def _check_bytes(where: str, value: str) -> None:
    if not _BYTES_RE.fullmatch(value) or int(value) >= 2**64:
        raise LimitsFileError(f"{where}: {value!r} is not a byte count; allowed: 0..2^64-1")


def _check_value(where: str, key: str, value: str) -> None:
    m = _INDEXED_RE.fullmatch(key)
    if m:
        if int(m.group(2)) >= MAX_DEVICES:
            raise LimitsFileError(
                f"{where}: device index {m.group(2)} out of range; allowed: 0..{MAX_DEVICES - 1}"
            )
        if m.group(1) == MEMORY_KEY:
            _check_bytes(where, value)
        else:
            try:
                parse_permille(value, where)
            except PercentError as e:
                raise LimitsFileError(str(e)) from e
    elif key == "VGPU_COMPUTE_POLICY":
        if value not in POLICIES:
            raise LimitsFileError(f"{where}: {value!r} unknown; allowed: {', '.join(POLICIES)}")
    elif key == "CUDA_TASK_PRIORITY":
        lo, hi = PRIORITY_RANGE
        if not _INT_RE.fullmatch(value) or not lo <= int(value) <= hi:
            raise LimitsFileError(f"{where}: {value!r} is not a priority; allowed: {lo}..{hi}")
    elif key == "VGPU_CONTEXT_RESERVE":
        _check_bytes(where, value)
    elif m := _CONTEXT_SIZE_RE.fullmatch(key):
        if int(m.group(1)) >= MAX_DEVICES:
            raise LimitsFileError(
                f"{where}: device index {m.group(1)} out of range; allowed: 0..{MAX_DEVICES - 1}"
            )
        _check_bytes(where, value)
    elif key in PATH_KEYS:
        if not value.startswith("/") or len(value) > MAX_PATH or "\0" in value:
            raise LimitsFileError(
                f"{where}: {value!r} is not an absolute path of at most {MAX_PATH} bytes"
            )
    else:
        allowed = [f"{MEMORY_KEY}<i>", f"{SM_KEY}<i>", "VGPU_COMPUTE_POLICY",
                   "CUDA_TASK_PRIORITY", "VGPU_CONTEXT_RESERVE", f"{CONTEXT_SIZE_KEY}<i>",
                   *PATH_KEYS]  # fmt: skip
        raise LimitsFileError(f"{where}: key {key!r} unknown; allowed: {', '.join(allowed)}")


def _check_complete(values: dict[str, str]) -> None:
    for key in _REQUIRED:
        if key not in values:
            raise LimitsFileError(f"limits file: {key} missing")
    mem = sorted(int(k[len(MEMORY_KEY) :]) for k in values if k.startswith(MEMORY_KEY))
    sm = sorted(int(k[len(SM_KEY) :]) for k in values if k.startswith(SM_KEY))
    if not mem:
        raise LimitsFileError(f"limits file: no {MEMORY_KEY}<i>; at least device 0 is needed")
    if mem != list(range(len(mem))):
        raise LimitsFileError(f"limits file: {MEMORY_KEY}<i> indices {mem} are not 0..n-1")
    if sm != mem:
        raise LimitsFileError(
            f"limits file: {SM_KEY}<i> indices {sm} differ from {MEMORY_KEY}<i> indices {mem}"
        )
    for k in values:
        if k.startswith(CONTEXT_SIZE_KEY) and int(k[len(CONTEXT_SIZE_KEY) :]) not in mem:
            raise LimitsFileError(f"limits file: {k} names no device of {MEMORY_KEY}<i> {mem}")


def parse_limits_file(text: str) -> dict[str, str]:
    """The file's KEY -> VALUE pairs, checked. LimitsFileError (one line) on any fault."""
    if len(text.encode("utf-8", "surrogateescape")) > MAX_FILE_BYTES:
        raise LimitsFileError(f"limits file: larger than {MAX_FILE_BYTES} bytes")
    values: dict[str, str] = {}
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip() or line.startswith("#"):
            continue
        where = f"limits file line {n}"
        if not line.isascii() or not line.isprintable():
            raise LimitsFileError(f"{where}: non-printable or non-ASCII characters")
        key, sep, value = line.partition("=")
        if not sep:
            raise LimitsFileError(f"{where}: {line[:60]!r} is not KEY=VALUE")
        if key in values:
            raise LimitsFileError(f"{where}: {key} appears twice")
        _check_value(f"{where} ({key})", key, value)
        values[key] = value
    _check_complete(values)
    return values


def render_limits_file(
    *,
    memory_limits: Sequence[int],
    sm_limits: Sequence[int],
    policy: str,
    priority: int,
    shared_cache: str,
    node_state_dir: str | None = None,
    demand_file: str | None = None,
    context_reserve: int | None = None,
    context_sizes: Sequence[int | None] = (),
) -> str:
    """The file's text for one slice; limits (and context sizes, None where unknown) in container
    device order. Checked as parse_limits_file checks it (LimitsFileError), so the plugin never writes a file the shim would refuse."""
    if len(memory_limits) != len(sm_limits):
        raise LimitsFileError(
            f"limits file: {len(memory_limits)} memory limits but {len(sm_limits)} SM limits"
        )
    lines = ["# vgpu-sharing limits of one slice; written by the DRA plugin, read by the shim"]
    lines += [f"{MEMORY_KEY}{i}={v}" for i, v in enumerate(memory_limits)]
    lines += [f"{SM_KEY}{i}={v}" for i, v in enumerate(sm_limits)]
    lines += [f"VGPU_COMPUTE_POLICY={policy}", f"CUDA_TASK_PRIORITY={priority}"]
    if context_reserve is not None:
        lines.append(f"VGPU_CONTEXT_RESERVE={context_reserve}")
    lines += [f"{CONTEXT_SIZE_KEY}{i}={v}" for i, v in enumerate(context_sizes) if v is not None]
    lines.append(f"CUDA_DEVICE_MEMORY_SHARED_CACHE={shared_cache}")
    if node_state_dir is not None:
        lines.append(f"VGPU_NODE_STATE_DIR={node_state_dir}")
    if demand_file is not None:
        lines.append(f"VGPU_DEMAND_FILE={demand_file}")
    text = "\n".join(lines) + "\n"
    parse_limits_file(text)  # the same rules both ways
    return text

"""The limits file of a slice: its limits, written by the plugin (or `vgpu run` for observers).

The DRA plugin writes it at prepare (sharing/claimlayout.py: the claim directory's `limits`,
mode 0444, owned by root) and mounts it read-only into the claim's containers at
claimlayout.CONTAINER_LIMITS. When the shim finds it, every limit comes from it and the
environment's limits and kill switches are ignored: the tenant owns its environment, not its
limits (docs/shim.md).

Format: text, one `KEY=VALUE` per line; blanks around a line are ignored, `#` after them starts a
comment, blank lines are ignored; no quoting. The keys, their value forms and which are required
are one table, shim/include/vgpu/limits.def, checked by one C function (shim/src/limitkeys.c)
that the shim runs on the file it reads and this module runs, through the cffi binding, on every
file it writes or reads: the two sides cannot disagree on what is a valid file.

Every error is a LimitsFileError whose str() is one line naming the key and what is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sharing._region_cffi import ffi, lib

MAX_FILE_BYTES = 64 * 1024  # as the shim: a reader never slurps an unbounded file
_WHY_BYTES = 1024

# The compute policies (the POLICY form of vgpu/limits.def), and the HAMi-core spelling the shim
# also takes from the environment (GPU_CORE_UTILIZATION_POLICY, when VGPU_COMPUTE_POLICY is unset).
POLICIES = ("hard", "elastic", "off")
HAMI_POLICIES = {"force": "hard", "default": "elastic", "disable": "off"}

MEMORY_KEY = "CUDA_DEVICE_MEMORY_LIMIT_"
SM_KEY = "CUDA_DEVICE_SM_LIMIT_"
CONTEXT_SIZE_KEY = "VGPU_CONTEXT_SIZE_"
BURST_LIMIT_KEY = "VGPU_MEMORY_BURST_LIMIT_"
BURST_GRANT_KEY = "VGPU_BURST_GRANT_"
BURST_KEY_KEY = "VGPU_BURST_KEY_"


@dataclass(frozen=True)
class BurstLimit:
    """A device's burst limit (bytes, at least its request) and its grant entry in the pool file
    (sharing/burstpool.py) with that entry's key (docs/policy.md, "The pool file")."""

    limit: int
    entry: int
    key: int


class LimitsFileError(ValueError):
    """A limits file (or the values for one) that cannot be used. str() is one line."""


def _entries(text: str) -> list[str]:
    """The file's KEY=VALUE entries, split as the shim splits them (shim/src/settings.c)."""
    out = []
    for line in text.split("\n"):
        s = line.rstrip("\r \t").lstrip(" \t")
        if s and not s.startswith("#"):
            out.append(s)
    return out


def parse_limits_file(text: str) -> dict[str, str]:
    """The file's KEY -> VALUE pairs, checked. LimitsFileError (one line) on any fault."""
    raw = text.encode("utf-8", "surrogateescape")
    if len(raw) > MAX_FILE_BYTES:
        raise LimitsFileError(f"limits file: larger than {MAX_FILE_BYTES} bytes")
    if b"\0" in raw:
        raise LimitsFileError("limits file: a NUL byte")
    entries = _entries(text)
    keep = [ffi.new("char[]", e.encode("utf-8", "surrogateescape")) for e in entries]
    why = ffi.new("char[]", _WHY_BYTES)
    if lib.vgpu_limits_check(ffi.new("char *[]", [*keep, ffi.NULL]), why, _WHY_BYTES) != 0:
        raise LimitsFileError(f"limits file: {ffi.string(why).decode('ascii', 'replace')}")
    return dict(e.split("=", 1) for e in entries)


def render_limits_file(
    *,
    memory_limits: Sequence[int],
    sm_limits: Sequence[int | str],
    policy: str,
    priority: int,
    shared_cache: str,
    node_state_dir: str | None = None,
    demand_file: str | None = None,
    context_reserve: int | None = None,
    context_sizes: Sequence[int | None] = (),
    bursts: Sequence[BurstLimit | None] = (),
    burst_pool: str | None = None,
    show_limit: bool = False,
    header: str = "written by the DRA plugin, read by the shim",
) -> str:
    """The file's text for one slice; limits (and context sizes, None where unknown) in container
    device order. Checked as the shim checks it (LimitsFileError), so no writer ever leaves a file the shim would refuse."""
    if len(memory_limits) != len(sm_limits):
        raise LimitsFileError(
            f"limits file: {len(memory_limits)} memory limits but {len(sm_limits)} SM limits"
        )
    lines = [f"# vgpu-sharing limits of one slice; {header}"]
    lines += [f"{MEMORY_KEY}{i}={v}" for i, v in enumerate(memory_limits)]
    lines += [f"{SM_KEY}{i}={v}" for i, v in enumerate(sm_limits)]
    lines += [f"VGPU_COMPUTE_POLICY={policy}", f"VGPU_PRIORITY={priority}"]
    if context_reserve is not None:
        lines.append(f"VGPU_CONTEXT_RESERVE={context_reserve}")
    lines += [f"{CONTEXT_SIZE_KEY}{i}={v}" for i, v in enumerate(context_sizes) if v is not None]
    lines.append(f"CUDA_DEVICE_MEMORY_SHARED_CACHE={shared_cache}")
    if node_state_dir is not None:
        lines.append(f"VGPU_NODE_STATE_DIR={node_state_dir}")
    if demand_file is not None:
        lines.append(f"VGPU_DEMAND_FILE={demand_file}")
    for i, b in enumerate(bursts):
        if b is not None:
            lines.append(f"{BURST_LIMIT_KEY}{i}={b.limit}")
            lines.append(f"{BURST_GRANT_KEY}{i}={b.entry}")
            lines.append(f"{BURST_KEY_KEY}{i}={b.key}")
    if burst_pool is not None:
        lines.append(f"VGPU_BURST_POOL={burst_pool}")
    if show_limit:
        lines.append("VGPU_MEMORY_SHOW_LIMIT=1")
    text = "\n".join(lines) + "\n"
    parse_limits_file(text)  # the same rules both ways
    return text

"""What a set of settings makes the shim enforce: per-device memory quotas and compute caps, the
compute policy and the priority.

The shim resolves its settings (the environment, or the plugin's limits file) with
shim/src/enforced.c; this module runs that same C function through the cffi binding, so
`vgpu run` can show, check and record exactly what the shim will enforce (defaults,
precedences such as PREFIX_<i> over PREFIX or VGPU_PRIORITY over CUDA_TASK_PRIORITY, and
refusals) instead of re-deriving them in Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sharing._region_cffi import ffi, lib
from sharing.logsafe import printable

__all__ = ["Enforced", "SettingError", "resolve"]

_POLICY_NAMES = {
    lib.VGPU_COMPUTE_POLICY_HARD: "hard",
    lib.VGPU_COMPUTE_POLICY_ELASTIC: "elastic",
    lib.VGPU_COMPUTE_POLICY_OFF: "off",
}


class SettingError(ValueError):
    """A setting the shim would refuse (and so fail cuInit). str() is the shim's one line
    (shim/src/log.c, vgpu_config_error)."""


@dataclass(frozen=True)
class Enforced:
    """What the shim enforces, per device index as the program sees it (VGPU_MAX_DEVICES of
    them: PREFIX sets every one, PREFIX_<i> one)."""

    disabled: bool  # CUDA_DISABLE_CONTROL=true: passthrough, nothing enforced
    memory: tuple[int, ...]  # bytes per device; 0 = no quota
    cap_permille: tuple[int, ...]  # compute cap per device, permille; 0 = no cap
    policy: str  # hard, elastic or off
    priority: int  # -100..100, lower is served first (elastic idle time)

    @property
    def any_limit(self) -> bool:
        if self.disabled:
            return False
        return any(self.memory) or (self.policy != "off" and any(self.cap_permille))

    def distinct_devices(self) -> int:
        """n such that devices n-1 and above all have the same limits: devices 0..n-2 were named
        one by one, device n-1 stands for the rest."""
        pairs = list(zip(self.memory, self.cap_permille, strict=True))
        differ = [i for i in range(len(pairs) - 1) if pairs[i] != pairs[-1]]
        return max(differ) + 2 if differ else 1


def resolve(env: Mapping[str, str]) -> Enforced:
    """What the shim would enforce in a process with environment env (no limits file).
    SettingError (the shim's one line) for a setting the shim would refuse."""
    keep = [
        ffi.new("char[]", f"{k}={v}".encode("utf-8", "surrogateescape")) for k, v in env.items()
    ]
    entries = ffi.new("char *[]", [*keep, ffi.NULL])
    out = ffi.new("struct vgpu_enforced *")
    fault = ffi.new("struct vgpu_setting_fault *")
    if lib.vgpu_enforced_resolve(entries, out, fault) != 0:
        var = ffi.string(fault.var).decode("utf-8", "backslashreplace")
        value = ffi.string(fault.value).decode("utf-8", "backslashreplace")
        why = ffi.string(fault.why).decode()
        forms = ffi.string(fault.forms).decode()
        raise SettingError(f'{var}="{printable(value)}" is invalid ({why}); accepted: {forms}')
    return Enforced(
        disabled=bool(out.disabled),
        memory=tuple(out.memory),
        cap_permille=tuple(out.cap),
        policy=_POLICY_NAMES[out.policy],
        priority=int(out.priority),
    )

"""`vgpu run`: run a command with the shim preloaded and the slice's limits set, without Kubernetes.

    vgpu run [--memory Q] [--memory-<i> Q] [--memory-limit Q] [--memory-limit-<i> Q]
             [--show-memory-limit] [--region FILE] [--sim] [--show] -- CMD [ARGS...]

The command replaces this process (exec), so its exit code, signals and pid are the command's.

Extending (sharing/cli/compute_run.py adds --compute/--policy): write an `EnvContributor`
(sharing/cli/run_flags.py: add_arguments + env) and append it to `CONTRIBUTORS` below. Each contributor adds its own flags and turns the
parsed arguments into environment variables; it raises `RunConfigError` (one line) for a bad
value, which is reported before the command starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sharing import burstpool, enforced, region
from sharing.claimlayout import REGION_LIMITS_SUFFIX
from sharing.cli.compute_run import COMPUTE
from sharing.cli.context_cache import CacheUntrusted, ContextCache, model_key
from sharing.cli.run_flags import EnvContributor, RunConfigError, add_per_device, per_device_env
from sharing.fsutil import atomic_write
from sharing.limitsfile import (
    BURST_GRANT_KEY,
    BURST_KEY_KEY,
    BURST_LIMIT_KEY,
    BurstLimit,
    LimitsFileError,
    render_limits_file,
)
from sharing.paths import shim_library, sim_lib_dir
from sharing.percent import format_permille
from sharing.quantity import QuantityError, format_bytes, parse_bytes

__all__ = ["CONTRIBUTORS", "EnvContributor", "RunConfigError", "build_env", "register", "run"]


class MemoryContributor:
    """--memory / --memory-<i>: CUDA_DEVICE_MEMORY_LIMIT[_i] in plain bytes."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_per_device(
            parser,
            "memory",
            "QUANTITY",
            "device memory quota for every device (e.g. 4Gi, 512Mi, 4g, 1073741824); "
            "0 = no limit (as the shim's CUDA_DEVICE_MEMORY_LIMIT=0)",
            "quota for device <i> as the command sees it (0 = no limit on it)",
        )

    def env(self, args: argparse.Namespace) -> dict[str, str]:
        return per_device_env(args, "memory", "CUDA_DEVICE_MEMORY_LIMIT", _bytes)


def _bytes(flag: str, text: str) -> str:
    try:
        value = parse_bytes(text, what=flag)
    except QuantityError as e:
        raise RunConfigError(str(e)) from e
    if value >= 2**64:
        raise RunConfigError(f"{flag}: {text!r} is larger than 2^64 bytes")
    if 0 < value < MIN_QUOTA:
        # No allocation fits in less than a page: a quota this small is a missing unit.
        t = text.strip()
        unit = f" (e.g. {t}Gi or {t}Mi)" if t.isdigit() else ""
        raise RunConfigError(
            f"{flag}: {text!r} is {value} bytes, less than any allocation; give a quota of "
            f"at least 1Mi with its unit{unit}, or 0 for no limit"
        )
    return str(value)


MIN_QUOTA = 1 << 20  # bytes; the smallest quota `vgpu run` takes (a GPU page is 2 MiB)


class BurstContributor:
    """--memory-limit / --memory-limit-<i>: a limit above the quota (then the request) that CMD
    may burst to (docs/policy.md): VGPU_MEMORY_BURST_LIMIT[_i] in plain bytes; the pool it borrows
    from is prepare_burst's. --show-memory-limit: VGPU_MEMORY_SHOW_LIMIT=1."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_per_device(
            parser,
            "memory-limit",
            "QUANTITY",
            "burst limit for every device (at least --memory, the request): CMD may allocate up "
            "to it and is shown the request as the device's total (e.g. --memory 4Gi "
            "--memory-limit 8Gi)",
            "burst limit for device <i> as the command sees it",
        )
        parser.add_argument(
            "--show-memory-limit",
            action="store_true",
            help="show CMD the burst limit as the device's total (default: the request)",
        )

    def env(self, args: argparse.Namespace) -> dict[str, str]:
        env = per_device_env(args, "memory-limit", "VGPU_MEMORY_BURST_LIMIT", _bytes)
        if args.show_memory_limit:
            env["VGPU_MEMORY_SHOW_LIMIT"] = "1"
        return env


MEMORY = MemoryContributor()
BURST = BurstContributor()
# Every contributor of flags and environment.
CONTRIBUTORS: list[EnvContributor] = [MEMORY, BURST, COMPUTE]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a command with the GPU-sharing shim and its limits",
        description="Run CMD with libvgpu.so preloaded and the slice's limits set; exits with CMD's code.",
    )
    for c in CONTRIBUTORS:
        c.add_arguments(p)
    p.add_argument(
        "--region",
        metavar="FILE",
        help="accounting file shared by every `vgpu run` given the same FILE (created if missing); "
        "without it, the processes of CMD share a quota of their own",
    )
    p.add_argument("--sim", action="store_true", help="run on the simulated GPU")
    p.add_argument(
        "--show",
        action="store_true",
        help="print what the shim would enforce (resolved by the shim's own code from the flags "
        "and the environment) and exit; CMD is not run",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")
    p.set_defaults(func=run)


def build_env(args: argparse.Namespace, base: dict[str, str]) -> dict[str, str]:
    """The command's environment: base + every contributor's variables + the preload.

    Raises RunConfigError for a bad argument. Does not touch the region (see prepare_region).
    """
    env = dict(base)
    for c in CONTRIBUTORS:
        env.update(c.env(args))
    shim = str(shim_library())
    # After any existing entries: a sanitizer runtime, if preloaded, must stay first.
    preload = [x for x in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if x and x != shim]
    env["LD_PRELOAD"] = ":".join([*preload, shim])
    if args.sim:
        libs = [str(sim_lib_dir()), *[x for x in env.get("LD_LIBRARY_PATH", "").split(":") if x]]
        env["LD_LIBRARY_PATH"] = ":".join(libs)
    return env


def prepare_region(args: argparse.Namespace, env: dict[str, str]) -> int | None:
    """Point CUDA_DEVICE_MEMORY_SHARED_CACHE at the slice's region; returns an fd to keep open.

    --region FILE: created if missing, validated if present (it holds usage only: the limits
    reach CMD through its environment).
    Otherwise, when any limit is set: an anonymous region in a memfd that CMD inherits, published
    as /proc/<pid>/fd/<n> (pid is this process, which exec turns into CMD), so CMD's children
    share CMD's quota and compute budget.
    """
    if args.region is not None:
        if not args.region.strip():
            raise RunConfigError("--region: empty; give the accounting file's path")
        path = os.path.abspath(args.region)
        try:
            region.create(path)
            region.read(path)
        except (region.RegionError, OSError) as e:
            raise RunConfigError(f"--region: {e}") from e
        try:
            write_region_limits(path, env)
        except (region.RegionError, LimitsFileError, OSError) as e:
            # Only observers read it (the shim takes the limits from CMD's environment): a file
            # shared from a directory this user may not write still runs, limited as asked.
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            print(f"vgpu run: --region: cannot write {path}{REGION_LIMITS_SUFFIX} ({reason}); "
                  "`vgpu top` and the exporter will show this slice without limits",
                  file=sys.stderr)  # fmt: skip
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = path
        return None
    # Any limit (memory or a contributor's, e.g. a compute cap) makes CMD's processes one slice.
    if "CUDA_DEVICE_MEMORY_SHARED_CACHE" in env or not any(c.env(args) for c in CONTRIBUTORS):
        return None
    fd = region.create_anonymous()
    os.set_inheritable(fd, True)
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = f"/proc/{os.getpid()}/fd/{fd}"
    return fd


BURST_KEY = 1  # the key of every grant entry of `vgpu run`'s own pool


def prepare_burst(
    args: argparse.Namespace, env: dict[str, str], shim_view: enforced.Enforced
) -> int | None:
    """A pool of CMD's own for --memory-limit (returns its fd, inherited by CMD; None without
    bursting). Without Kubernetes no other claim shares the GPU through the plugin, so each
    bursting device's grant is its whole limit - request and nothing is taken back: CMD may use its
    limit, is shown its request (docs/policy.md). A bare --memory-limit applies to every device
    NVML lists (the shim names each device's grant entry: VGPU_BURST_GRANT_<i>, _KEY_<i>)."""
    bare_text = env.pop("VGPU_MEMORY_BURST_LIMIT", None)
    bare = int(_bytes("--memory-limit", bare_text)) if bare_text is not None else None
    limits: dict[int, int] = {}
    for k in [k for k in env if k.startswith(BURST_LIMIT_KEY)]:  # flags' or the environment's
        index = k[len(BURST_LIMIT_KEY) :]
        if not index.isdigit() or int(index) >= region.MAX_DEVICES:
            raise RunConfigError(f"{k}: not a device index (0..{region.MAX_DEVICES - 1})")
        limits[int(index)] = int(_bytes(f"--memory-limit-{int(index)}", env.pop(k)))
    if bare is not None:
        count = _gpu_count(args.sim)
        if count == 0:
            raise RunConfigError(
                "--memory-limit: NVML lists no GPU to apply it to; name devices with --memory-limit-<i>"
            )
        limits = {i: limits.get(i, int(bare)) for i in range(count)} | limits
    if not limits:
        return None
    fd = burstpool.create_anonymous()
    with burstpool.Pool(fd=fd, writable=True) as pool:
        for i, limit in sorted(limits.items()):
            request = shim_view.memory[i]  # the quota as the shim resolves it
            flag = "--memory-limit" if bare is not None else f"--memory-limit-{i}"
            if request == 0:
                raise RunConfigError(
                    f"{flag}: device {i} has no --memory (the request) to burst above"
                )
            if limit < request:
                raise RunConfigError(
                    f"{flag}: {limit} bytes is below device {i}'s --memory ({request} bytes, the request)"
                )
            pool.write_grant(i, key=BURST_KEY, device=i, state=burstpool.GRANT_OPEN,
                             request=request, limit=limit, grant=limit - request)  # fmt: skip
            env[f"VGPU_MEMORY_BURST_LIMIT_{i}"] = str(limit)
            env[f"VGPU_BURST_GRANT_{i}"] = str(i)
            env[f"VGPU_BURST_KEY_{i}"] = str(BURST_KEY)
    os.set_inheritable(fd, True)
    env["VGPU_BURST_POOL"] = f"/proc/{os.getpid()}/fd/{fd}"
    return fd


def _gpu_count(sim: bool) -> int:
    """How many GPUs NVML lists (0 when it cannot say)."""
    import pynvml

    from sharing.gpus import list_gpus, use_simulator

    try:
        if sim:
            use_simulator()
        return len(list_gpus())
    except (pynvml.NVMLError, OSError):
        return 0


def write_region_limits(path: str, env: Mapping[str, str]) -> None:
    """FILE.limits beside a --region FILE: the limits this run gives CMD, as the shim resolves
    them from its environment (sharing/enforced.py runs the shim's own resolver), in the
    limits-file format, for observers (`vgpu top`, the exporter; the accounting file holds usage
    only). The shim does not read it: CMD's environment carries the limits. Written atomically,
    never through a link (sharing.fsutil.atomic_write), in the region's checked directory."""
    try:
        e = enforced.resolve(env)
    except enforced.SettingError as err:
        raise LimitsFileError(str(err)) from err
    bursting = [int(k[len(BURST_LIMIT_KEY) :]) for k in env if k.startswith(BURST_LIMIT_KEY)]
    n = max(e.distinct_devices(), max(bursting, default=-1) + 1)
    bursts = [
        BurstLimit(int(env[f"{BURST_LIMIT_KEY}{i}"]), int(env[f"{BURST_GRANT_KEY}{i}"]),
                   int(env[f"{BURST_KEY_KEY}{i}"]))
        if i in bursting
        else None
        for i in range(n)
    ]  # fmt: skip
    text = render_limits_file(
        memory_limits=e.memory[:n],
        sm_limits=[format_permille(c) if c else "100" for c in e.cap_permille[:n]],  # the whole GPU
        policy=e.policy,
        priority=e.priority,
        shared_cache=path,
        bursts=bursts,
        burst_pool=env.get("VGPU_BURST_POOL"),
        show_limit=env.get("VGPU_MEMORY_SHOW_LIMIT") == "1",
        header="written by vgpu run for observers; the shim reads CMD's environment",
    )
    os.close(region.open_dir(path + REGION_LIMITS_SUFFIX)[0])  # the region's checked directory
    atomic_write(Path(path + REGION_LIMITS_SUFFIX), text.encode())


def describe(e: enforced.Enforced) -> list[str]:
    """What the shim enforces, a line per device named on its own and one for the rest (--show)."""
    if e.disabled:
        return ["nothing: CUDA_DISABLE_CONTROL=true (the shim passes every call through)"]
    if not e.any_limit:
        return ["no limit on any device (memory and compute unlimited)"]
    n = e.distinct_devices()
    last = len(e.memory) - 1
    lines = []
    for i in range(n):
        mem, cap = e.memory[i], e.cap_permille[i]
        quota = format_bytes(mem) if mem else "no quota"
        if cap and e.policy != "off":
            compute = f"compute {format_permille(cap)}% ({e.policy}, priority {e.priority})"
        elif cap:
            compute = f"compute uncapped (policy off: {format_permille(cap)}% not enforced)"
        else:
            compute = "compute uncapped"
        which = "every device" if n == 1 else f"device {i}" if i < n - 1 else f"devices {i}-{last}"
        lines.append(f"{which}: memory {quota}, {compute}")
    return lines


def hand_over_context_size(args: argparse.Namespace, env: dict[str, str]) -> None:
    """VGPU_CONTEXT_SIZE for CMD from this user's cache (sharing/cli/context_cache.py), so that the
    run's first process need not measure a context on its start-up path; a --region FILE whose
    processes measured one teaches the cache. Only where every GPU is of one model (which CUDA
    index is which NVML device is not known here) and the environment names no size itself."""
    if any(k == "VGPU_CONTEXT_SIZE" or k.startswith("VGPU_CONTEXT_SIZE_") for k in env):
        return
    cache = ContextCache.for_user(env)
    try:
        sizes = cache.read()
        taught = _region_context_size(args.region) if args.region else 0
        if not sizes and not taught:
            return  # nothing to hand over or learn: NVML is not asked
        keys = _gpu_models(args.sim)
        if len(keys) != 1:
            return
        (key,) = keys
        if taught:
            cache.remember(key, taught)
            sizes[key] = taught
    except CacheUntrusted as e:
        print(f"vgpu run: context-size cache ignored: {e}", file=sys.stderr)
        return
    except OSError as e:
        print(f"vgpu run: context-size cache not used: {e}", file=sys.stderr)
        return
    if key in sizes:
        env["VGPU_CONTEXT_SIZE"] = str(sizes[key])


def _region_context_size(path: str) -> int:
    """The context size a --region FILE's processes measured through NVML (the driver's figure
    for this GPU model), 0 when none or when its devices disagree."""
    try:
        snap = region.read(os.path.abspath(path))
    except (region.RegionError, OSError):
        return 0  # a new or foreign file: prepare_region reports what is wrong with it
    measured = {d.context_bytes for d in snap.devices if d.context_bytes}
    return measured.pop() if len(measured) == 1 else 0


def _gpu_models(sim: bool) -> set[str]:
    """The node's GPU models as cache keys; empty when NVML cannot say."""
    import pynvml

    from sharing.gpus import list_gpus, use_simulator

    try:
        if sim:
            use_simulator()
        return {model_key(g.name, g.memory_total, g.driver_version) for g in list_gpus()}
    except (pynvml.NVMLError, OSError):
        return set()


def run(args: argparse.Namespace) -> int:
    cmd: list[str] = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd and not args.show:
        print("vgpu run: no command given (vgpu run [options] -- CMD [ARGS...])", file=sys.stderr)
        return 2
    try:
        env = build_env(args, dict(os.environ))
        try:
            # the shim would refuse to start (cuInit fails) on a setting it cannot read: say so now
            shim_view = enforced.resolve(env)
        except enforced.SettingError as e:
            raise RunConfigError(f"the shim would refuse {e}") from e
        if args.show:
            for line in describe(shim_view):
                print(line)
            return 0
        hand_over_context_size(args, env)
        prepare_burst(args, env, shim_view)
        prepare_region(args, env)
    except RunConfigError as e:
        print(f"vgpu run: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:
        print(f"vgpu run: cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - exec does not return

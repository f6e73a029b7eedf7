"""What a CUDA context takes on each GPU model, for the limits file's VGPU_CONTEXT_SIZE_<i>.

A slice's first process would otherwise measure its context through NVML on its start-up path
(docs/shim.md *Contexts*). The plugin learns the size once per GPU model and driver version: a
short-lived helper process (`python -m driver.contextsize`) creates a primary context on the GPU
and reads its own entry in NVML's process list (the PID that appears across the creation when
NVML lists host PIDs of another namespace). The answer is kept in memory and in
DATA/context-sizes.json (the plugin's data dir, 0644), keyed by model, memory and driver version:

    {"<GPU name> / <memory bytes> B / driver <version>": <bytes>, ...}

The helper uses the CUDA driver beside the NVML library the plugin loaded (the node's driver, or
the simulator's under --sim), with the plugin's environment. It runs on a thread of its own,
started for the node's models when the plugin starts: a prepare never runs it, and waits for one
under way at most PREPARE_WAIT_S. A model the helper could not measure (or not yet) gets no size
in its claims' limits (the shim then measures, as without the key); one it could not measure is
not asked again while the plugin runs.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sharing.fsutil import atomic_write
from sharing.gpus import GpuInfo

log = logging.getLogger(__name__)

CACHE_FILE = "context-sizes.json"
NVML_LIBRARY = "libnvidia-ml.so.1"
CUDA_LIBRARY = "libcuda.so.1"
PROBE_TIMEOUT_S = 120.0  # a driver bringing a GPU up for its first context can take seconds
PREPARE_WAIT_S = 10.0  # a prepare waits this long for a model being learned, then goes without
MAX_SIZE = 1 << 50  # above any GPU's memory: not a context size


def model_key(gpu: GpuInfo) -> str:
    """A context's size depends on the GPU model and the driver, not on the GPU."""
    return f"{gpu.name} / {gpu.memory_total} B / driver {gpu.driver_version}"


def loaded_nvml_dir(maps: Path = Path("/proc/self/maps")) -> Path | None:
    """The directory of the NVML library this process has loaded, or None."""
    try:
        text = maps.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if path.endswith("/" + NVML_LIBRARY):
            return Path(path).parent
    return None


@dataclass
class ContextSizes:
    """The limits' context sizes of a claim's GPUs, learned once per model (thread-safe).

    Learning runs on a thread of its own, never under a prepare: the plugin starts it for its
    GPUs' models at start-up (`learn`), and a prepare that meets a model still being learned
    waits at most `wait_s` for it, then goes on without the size (the shim measures) instead of
    holding the kubelet's call for as long as a driver may take to bring a GPU up."""

    data_dir: Path
    lib_dir: Path | None = None  # None: beside the NVML library this process loaded
    wait_s: float = PREPARE_WAIT_S
    helper: tuple[str, ...] = (sys.executable, "-m", "driver.contextsize")
    after_probe: Callable[[], None] | None = None  # e.g. share the simulator's new state files
    _known: dict[str, int | None] = field(default_factory=dict)  # None: could not measure
    _learning: dict[str, threading.Event] = field(default_factory=dict)
    _loaded: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def learn(self, gpus: Sequence[GpuInfo]) -> None:
        """Start learning, in the background, the models of `gpus` not known yet."""
        with self._lock:
            self._load()
            for g in gpus:
                self._start(g)

    def for_gpus(self, gpus: Sequence[GpuInfo]) -> list[int | None]:
        with self._lock:
            self._load()
            pending = {id(e): e for e in (self._start(g) for g in gpus) if e is not None}
        deadline = time.monotonic() + self.wait_s
        for e in pending.values():
            e.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            sizes = []
            for g in gpus:
                key = model_key(g)
                if key not in self._known:
                    log.info(
                        "context size on %s: still being learned after %gs; this claim's shim"
                        " measures it",
                        key,
                        self.wait_s,
                    )
                sizes.append(self._known.get(key))
            return sizes

    def _load(self) -> None:  # under _lock
        if not self._loaded:
            self._known.update(self._read_cache())
            self._loaded = True

    def _start(self, gpu: GpuInfo) -> threading.Event | None:
        """The learning of gpu's model (started now if need be); None when it is known. Under
        _lock."""
        key = model_key(gpu)
        if key in self._known:
            return None
        event = self._learning.get(key)
        if event is None:
            event = self._learning[key] = threading.Event()
            threading.Thread(
                target=self._learn, args=(gpu, key, event), name="context-size", daemon=True
            ).start()
        return event

    def _learn(self, gpu: GpuInfo, key: str, event: threading.Event) -> None:
        try:
            size = self._probe(gpu)
        except Exception:  # a bug here must not leave prepares waiting for nothing
            log.exception("context size on %s: helper failed; the shim measures", key)
            size = None
        if self.after_probe is not None:
            self.after_probe()
        with self._lock:  # the cache is written under it: two learnings never interleave
            self._known[key] = size
            del self._learning[key]
            if size is not None:
                self._write_cache()
        event.set()
        if size is not None:
            log.info("context size on %s: %d bytes (learned by a helper process)", key, size)

    def _write_cache(self) -> None:  # under _lock
        learned = {k: v for k, v in self._known.items() if v is not None}
        try:
            atomic_write(
                self._cache_path, (json.dumps(learned, indent=1) + "\n").encode(), mode=0o644
            )
        except OSError as e:
            log.warning("context sizes: cannot write %s: %s", self._cache_path, e)

    @property
    def _cache_path(self) -> Path:
        return self.data_dir / CACHE_FILE

    def _read_cache(self) -> dict[str, int | None]:
        try:
            data = json.loads(self._cache_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("context sizes: ignoring %s (%s); measuring again", self._cache_path, e)
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            k: v
            for k, v in data.items()
            if isinstance(k, str) and type(v) is int and 0 < v < MAX_SIZE
        }

    def _probe(self, gpu: GpuInfo) -> int | None:
        lib_dir = self.lib_dir or loaded_nvml_dir()
        if lib_dir is None or not (lib_dir / CUDA_LIBRARY).exists():
            log.info(
                "context size on %s: no CUDA driver beside NVML; the shim measures", model_key(gpu)
            )
            return None
        cmd = [*self.helper, gpu.uuid, str(lib_dir)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning(
                "context size on %s: helper failed: %s; the shim measures", model_key(gpu), e
            )
            return None
        out = r.stdout.strip()
        if (
            r.returncode != 0
            or not out.isdigit()
            or not 0 < int(out) < min(gpu.memory_total, MAX_SIZE)
        ):
            why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}, output {out!r}"])[-1]
            log.warning(
                "context size on %s: not measured (%s); the shim measures", model_key(gpu), why
            )
            return None
        return int(out)


# ---- the helper process: create a context on one GPU, print what NVML says it took ----

NVML_VALUE_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF


def _uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def measure(uuid: str, lib_dir: Path) -> int:
    """Bytes this process's first context on GPU `uuid` took, by NVML's process list."""
    ctypes.CDLL(str(lib_dir / NVML_LIBRARY), mode=ctypes.RTLD_GLOBAL)  # pynvml's, by soname
    import pynvml

    cuda = ctypes.CDLL(str(lib_dir / CUDA_LIBRARY))
    if cuda.cuInit(0) != 0:
        raise RuntimeError("cuInit failed")
    count = ctypes.c_int()
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        raise RuntimeError("cuDeviceGetCount failed")
    dev = None
    for i in range(count.value):
        d, raw = ctypes.c_int(), ctypes.create_string_buffer(16)
        ok = cuda.cuDeviceGet(ctypes.byref(d), i) == 0 and cuda.cuDeviceGetUuid_v2(raw, d) == 0
        if ok and _uuid_text(raw.raw) == uuid:
            dev = d
    if dev is None:
        raise RuntimeError(f"no CUDA device {uuid}")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    before = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    ctx = ctypes.c_void_p()
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0 or cuda.cuCtxSetCurrent(ctx) != 0:
        raise RuntimeError("cannot create a context")
    after = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    mine = [p for p in after if p.pid == os.getpid()] or [p for p in after if p.pid not in before]
    if len(mine) != 1:
        raise RuntimeError(f"cannot tell this process's NVML entry ({len(mine)} candidates)")
    used = int(mine[0].usedGpuMemory or 0)
    if used in (0, NVML_VALUE_NOT_AVAILABLE):
        raise RuntimeError("NVML does not report per-process memory")
    return used


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m driver.contextsize GPU-UUID LIB_DIR", file=sys.stderr)
        return 64
    try:
        print(measure(argv[0], Path(argv[1])))
    except Exception as e:  # one line for the plugin's log, whatever failed
        print(f"context size: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Which container a GPU process runs in, and the device memory each container of a slice holds.

A claim can serve several containers (of one pod, or of the pods sharing the claim), all writing
one accounting file; its process slots hold PIDs in each container's own PID namespace, which
collide across containers. So the per-container figures come from outside, from what a tenant
cannot forge: NVML's per-process memory (host PIDs), the slice each process belongs to (the
watchdog's attribution: the accounting file it has mapped or open, else names), and the container
the kernel has put it in, its cgroup (/proc/<pid>/cgroup). The runtime names the leaf cgroup of a
container after the container's ID (containerd `cri-containerd-<id>.scope` or `.../<id>`, CRI-O
`crio-<id>.scope`, Docker `docker-<id>.scope`, podman `libpod-<id>`), and the kubelet's
hierarchy names the pod's UID (`pod<uid>`, or `kubepods-<qos>-pod<uid with _>.slice` under
systemd). A container sees its cgroup file system read-only (unless privileged), so it cannot
move itself to another container's cgroup.

The cgroup says the container's ID, not its name: the `container_id` label carries the ID's
first 12 hex digits (what `crictl ps` and `podman ps` show). The name comes from the kubelet: the
file it bind-mounts at each container's terminationMessagePath lives in
`<kubelet root>/pods/<pod uid>/containers/<container name>/`, and the kernel shows that source
in the process's /proc/<pid>/mountinfo (a container cannot mount without CAP_SYS_ADMIN, so
cannot forge it). sharing/observe/metrics.py joins the name with the kubelet's PodResources answer
(sharing/observe/podresources.py) for the pod's name. Needs the host's PIDs, like the watchdog.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from sharing.observe.nodeview import ContainerMemory, NodeView
from sharing.observe.nvml_reader import NvmlReading
from sharing.observe.procinfo import Container, attribute, container_of


class ContainerUsage:
    """The last NVML pass's memory by (slice key, device index in the slice) and container;
    written by the poller thread, read by scrapes."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._lock = threading.Lock()
        self._by_slice: dict[tuple[str, int], tuple[ContainerMemory, ...]] = {}
        self._cache: dict[tuple[int, int], Container] = {}  # (pid, start time) -> container

    def get(self, key: str, device: int) -> tuple[ContainerMemory, ...]:
        with self._lock:
            return self._by_slice.get((key, device), ())

    def update(self, view: NodeView, reading: NvmlReading, skip_pid: int = 0) -> None:
        """Attribute NVML's GPU processes of this pass to slices and containers."""
        files: Mapping[tuple[int, int], str] = {
            (c.st_dev, c.st_ino): key for key, c in view.counters.items()
        }
        devices = {d.gpu.uuid: d for d in view.devices}
        sums: dict[tuple[str, int], dict[Container, list[int]]] = {}
        cache: dict[tuple[int, int], Container] = {}
        for gpu in reading.gpus:
            dv = devices.get(gpu.uuid)
            if dv is None or not dv.slices:
                continue
            on_dev = {s.slice.key: s.device for s in dv.slices}
            for p in gpu.processes:
                if p.pid == skip_pid:
                    continue
                a = attribute(p.pid, self.proc_root, files)
                key = files.get(a.file_id) if a.file_id else None
                if key is None or key not in on_dev:
                    continue
                ident = (p.pid, a.start)
                c = self._cache.get(ident) or container_of(p.pid, self.proc_root)
                cache[ident] = c
                acc = sums.setdefault((key, on_dev[key]), {}).setdefault(c, [0, 0])
                acc[0] += p.used_bytes
                acc[1] += 1
        out = {
            k: tuple(
                ContainerMemory(c, used, n)
                for c, (used, n) in sorted(
                    v.items(), key=lambda cv: (cv[0].id, cv[0].pod_uid, cv[0].name)
                )
            )
            for k, v in sums.items()
        }
        with self._lock:
            self._by_slice = out
            self._cache = cache  # a process's cgroup is read once while it lives

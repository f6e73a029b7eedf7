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
cannot forge it). sharing/metrics.py joins the name with the kubelet's PodResources answer
(sharing/podresources.py) for the pod's name. Needs the host's PIDs, like the watchdog.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from sharing.nodeview import NodeView
from sharing.nvml_reader import NvmlReading
from sharing.watchdog import attribute

SHORT_ID = 12  # hex digits of a container ID shown, as container tools show them
# one path component naming a container (the innermost such component is the container's: podman
# may put the container's processes in a `container` leaf below it)
_CONTAINER = re.compile(r"(?:cri-containerd-|crio-|docker-|libpod-)?([0-9a-f]{64})(?:\.scope)?")
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD = re.compile(rf"pod({_UID})")
# the mount root of the kubelet's per-container file (terminationMessagePath), relative to its
# file system's root: /var/lib/kubelet/pods/... or /pods/... when the kubelet's root is a mount
_KUBELET_FILE = re.compile(
    rf"(?:^|/)pods/({_UID})/containers/([a-z0-9](?:[-a-z0-9]{{0,61}}[a-z0-9])?)/[^/]+"
)


@dataclass(frozen=True)
class Container:
    id: str  # the runtime's container ID, "" for a process in no container
    pod_uid: str  # the pod's UID from the kubelet's cgroup or mount names, "" when not under it
    name: str = ""  # the container's name in its pod (the kubelet's mounts), "" when unknown

    @property
    def short_id(self) -> str:
        return self.id[:SHORT_ID]


NO_CONTAINER = Container("", "")


def container_of_cgroup(text: str) -> Container:
    """The container a /proc/<pid>/cgroup file names (any hierarchy's path: v1 or v2)."""
    found = NO_CONTAINER
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        ids = [m.group(1) for part in path.split("/") if (m := _CONTAINER.fullmatch(part))]
        if not ids:
            continue
        pod = _POD.search(path)
        found = Container(ids[-1], pod.group(1).replace("_", "-") if pod else "")
        if found.pod_uid:
            break
    return found


def kubelet_container_of_mountinfo(text: str) -> tuple[str, str]:
    """(pod UID, container name) of the kubelet's per-container file among the mounts of a
    /proc/<pid>/mountinfo, ("", "") when none is mounted."""
    for line in text.splitlines():
        fields = line.split(" ", 4)
        if len(fields) == 5 and (m := _KUBELET_FILE.search(fields[3])):
            return m.group(1).replace("_", "-"), m.group(2)
    return "", ""


def container_of(pid: int, proc_root: str = "/proc") -> Container:
    """The container of a process (NO_CONTAINER when it is in none, or gone)."""
    try:
        with open(f"{proc_root}/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            c = container_of_cgroup(f.read())
    except OSError:
        return NO_CONTAINER
    try:
        with open(f"{proc_root}/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
            pod_uid, name = kubelet_container_of_mountinfo(f.read())
    except OSError:
        return c
    if not name or (c.pod_uid and pod_uid != c.pod_uid):
        return c  # a pod's mounts that disagree with its cgroup name nothing
    return Container(c.id, pod_uid, name)


@dataclass(frozen=True)
class ContainerMemory:
    container: Container
    used_bytes: int  # NVML's memory of the container's processes on the device
    processes: int


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

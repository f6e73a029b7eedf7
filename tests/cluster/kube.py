"""The real cluster of `scripts/cluster`, seen from the tests: kubectl, waits, and the host's state.

Only tests/cluster imports this (tests/README.md: a helper next to the tests of its area).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "cluster"
RUN = Path(os.environ.get("VGPU_CLUSTER_RUN", "/var/lib/vgpu-cluster"))
CACHE = Path(os.environ.get("VGPU_CLUSTER_CACHE", str(Path.home() / ".cache" / "vgpu-cluster")))
NODE = os.environ.get("VGPU_CLUSTER_NODE", "vgpu-node")
DRIVER = "vgpu.sharing.dev"
DATA_DIR = Path("/var/lib/vgpu-sharing")
CDI_ROOT = Path("/var/run/cdi")
BRIDGE = "vgpubr0"
CGROUP_ROOT = "vgpu-cluster"
# Host paths the cluster mounts under (scripts/cluster, our_mounts).
MOUNT_PREFIXES = (str(RUN), "/var/lib/kubelet", str(DATA_DIR))
SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.ipv4.conf.all.route_localnet",
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
)

Obj = dict[str, Any]


class KubectlError(RuntimeError):
    pass


@dataclass
class Cluster:
    """A running `scripts/cluster up --with-driver`: kubectl against it, and its mode."""

    env: dict[str, str]
    version: str
    up_seconds: float
    mode: str = ""  # "sharing" or "partition": what the plugin published
    host_before: HostState | None = None

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            ["kubectl", *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)}: rc={r.returncode}\n{r.stderr}")
        return r

    def get(self, *args: str) -> Obj:
        out: Obj = json.loads(self.kubectl("get", *args, "-o", "json").stdout)
        return out

    def apply(self, manifest: str | Path) -> None:
        if isinstance(manifest, Path):
            self.kubectl("apply", "-f", str(manifest))
        else:
            self.kubectl("apply", "-f", "-", input=manifest)

    def delete(self, manifest: str | Path, wait: bool = True) -> None:
        args = ["delete", "--ignore-not-found", f"--wait={str(wait).lower()}", "--timeout=120s"]
        if isinstance(manifest, Path):
            self.kubectl(*args, "-f", str(manifest), timeout=180)
        else:
            self.kubectl(*args, "-f", "-", input=manifest, timeout=180)

    def pod(self, name: str, namespace: str = "default") -> Obj:
        return self.get("pod", name, "-n", namespace)

    def wait_pod(
        self, name: str, phases: tuple[str, ...], timeout: float = 240, namespace: str = "default"
    ) -> Obj:
        """The pod once its phase is one of `phases`; a timeout says where it stood."""
        deadline = time.monotonic() + timeout
        pod: Obj = {}
        while time.monotonic() < deadline:
            pod = self.pod(name, namespace)
            if pod.get("status", {}).get("phase") in phases:
                return pod
            time.sleep(1)
        events = self.kubectl(
            "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
            check=False,
        ).stdout  # fmt: skip
        raise AssertionError(
            f"pod {name} not in {phases} after {timeout}s: "
            f"{json.dumps(pod.get('status'), indent=1)}\nevents:\n{events}"
        )

    def logs(self, pod: str, container: str | None = None) -> str:
        args = ["logs", pod] + (["-c", container] if container else [])
        return self.kubectl(*args).stdout

    def claim_of(self, pod: Obj, name: str | None = None) -> Obj:
        """The ResourceClaim a pod got: from a template (by its claim name), or the scheduler's
        claim for an extended resource."""
        status = pod.get("status", {})
        ns = pod["metadata"]["namespace"]
        for s in status.get("resourceClaimStatuses", []):
            if name is None or s["name"] == name:
                return self.get("resourceclaim", s["resourceClaimName"], "-n", ns)
        ext = status.get("extendedResourceClaimStatus")
        if ext:
            return self.get("resourceclaim", ext["resourceClaimName"], "-n", ns)
        raise AssertionError(f"pod {pod['metadata']['name']} has no claim: {status}")

    def slices(self) -> list[Obj]:
        items: list[Obj] = self.get("resourceslices", "--field-selector", f"spec.nodeName={NODE}")[
            "items"
        ]
        return [s for s in items if s["spec"]["driver"] == DRIVER]

    def wait_until(self, what: str, cond: Any, timeout: float = 120, every: float = 1) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = cond()
            if last:
                return last
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class ClaimRecorder:
    """Every ResourceClaim of a namespace as last seen allocated, polled in the background: the
    claims made from a pod's templates are deleted as soon as the pod is done, so a test reads
    them from here afterwards."""

    def __init__(self, cluster: Cluster, namespace: str = "default") -> None:
        self.cluster, self.namespace = cluster, namespace
        self.claims: dict[str, Obj] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ClaimRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            r = self.cluster.kubectl(
                "get", "resourceclaims", "-n", self.namespace, "-o", "json", check=False
            )
            if r.returncode == 0:
                for c in json.loads(r.stdout)["items"]:
                    if c.get("status", {}).get("allocation"):
                        self.claims[c["metadata"]["name"]] = c
            self._stop.wait(0.3)

    def claim_of(self, pod: Obj, timeout: float = 30) -> Obj:
        """The allocated claim of `pod` (its only claim, from a template or the scheduler's
        claim for an extended resource)."""
        status = pod.get("status", {})
        names = [s["resourceClaimName"] for s in status.get("resourceClaimStatuses", [])]
        names += [
            c["resourceClaimName"]
            for c in pod["spec"].get("resourceClaims", [])
            if c.get("resourceClaimName")
        ]
        if status.get("extendedResourceClaimStatus"):
            names.append(status["extendedResourceClaimStatus"]["resourceClaimName"])
        assert len(names) == 1, status
        deadline = time.monotonic() + timeout
        while names[0] not in self.claims and time.monotonic() < deadline:
            time.sleep(0.3)
        assert names[0] in self.claims, f"claim {names[0]} never seen allocated"
        return self.claims[names[0]]


def example_files(mode: str) -> list[Path]:
    """deploy/examples/<mode>/*.yaml."""
    return sorted((REPO / "deploy" / "examples" / mode).glob("*.yaml"))


def publish_mode(slices: list[Obj]) -> str:
    """sharing when the published devices allow multiple allocations (consumable capacity)."""
    for s in slices:
        for d in s["spec"].get("devices", []):
            if d.get("allowMultipleAllocations"):
                return "sharing"
    return "partition"


GPU_LINE = re.compile(r"GPU (\d+): ([0-9.]+) GiB visible, ([0-9.]+) GiB free")


def visible_gib(log: str) -> dict[int, float]:
    """{GPU index: GiB visible} from the examples' `GPU i: X GiB visible, Y GiB free` lines."""
    return {int(m[1]): float(m[2]) for m in GPU_LINE.finditer(log)}


PROGRAM = """
import ctypes as C, sys, time
cu = C.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0, "cuInit failed"
dev, ctx, free, total = C.c_int(), C.c_void_p(), C.c_size_t(), C.c_size_t()
cu.cuDeviceGet(C.byref(dev), 0)
cu.cuCtxCreate_v2(C.byref(ctx), 0, dev)
cu.cuMemGetInfo_v2(C.byref(free), C.byref(total))
print(f"GPU 0: {total.value / 2**30:.2f} GiB visible, {free.value / 2**30:.2f} GiB free", flush=True)
cu.cuCtxDestroy_v2(ctx)
time.sleep(100000)
"""


def claim_pod(name: str, memory_gi: int | None, cores: int, gpu_index: int = 0) -> str:
    """A ResourceClaim for a share of GPU `gpu_index` (sharing mode) and a pod that prints what it
    sees (`GPU 0: X GiB visible, ...`) and then sleeps."""
    program = "\n".join("            " + line for line in PROGRAM.strip().splitlines())
    capacity = (
        ""
        if memory_gi is None  # partition mode: one slice, no capacity to ask for
        else f"""          capacity:
            requests:
              memory: {memory_gi}Gi
              cores: "{cores}"
"""
    )
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: {name}
  namespace: default
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: {DRIVER}
          selectors:
            - cel:
                expression: device.attributes["{DRIVER}"].index == {gpu_index}
{capacity}---
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: default
spec:
  securityContext:
    seccompProfile: {{type: RuntimeDefault}}  # claim pods need one (deploy/base/admission.yaml)
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  resourceClaims:
    - name: gpu
      resourceClaimName: {name}
  containers:
    - name: cuda
      image: python:3.12-slim
      command: ["python3", "-c"]
      args:
        - |
{program}
      resources:
        claims:
          - name: gpu
"""


# --- what the cluster leaves on the host --------------------------------------------------------


@dataclass
class HostState:
    """The host's state that `scripts/cluster down` must restore."""

    links: set[str] = field(default_factory=set)
    sysctls: dict[str, str] = field(default_factory=dict)


def host_state() -> HostState:
    """The host as it is; while a cluster is up (or after one crashed), the sysctls as they were
    before it, which `up` saved and `down` restores."""
    links = set(json_cmd(["ip", "-j", "link", "show"], key="ifname"))
    sysctls = {}
    for s in SYSCTLS:
        r = subprocess.run(["sysctl", "-n", s], capture_output=True, text=True)
        if r.returncode == 0:
            sysctls[s] = r.stdout.strip()
    saved = CACHE / "sysctl.before"
    if saved.exists():
        for line in saved.read_text().splitlines():
            k, _, v = line.partition("=")
            if k in sysctls:
                sysctls[k] = v
    return HostState(links=links, sysctls=sysctls)


def json_cmd(cmd: list[str], key: str) -> list[str]:
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return [str(x[key]) for x in out]


def cluster_processes() -> list[str]:
    """Processes running a binary of the cluster's cache, or a shim of its containerd."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            exe = os.readlink(p / "exe")
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if exe.startswith(str(CACHE)) or f"-address {RUN}/" in cmd:
            found.append(f"{p.name}: {cmd[:200]}")
    return found


def cluster_mounts() -> list[str]:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4]
        if target.startswith(MOUNT_PREFIXES) or str(RUN) in line:
            mounts.append(target)
    return mounts


def cluster_cgroups() -> list[str]:
    return [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{CGROUP_ROOT}")]


def cluster_iptables() -> list[str]:
    """Chains and rules of kube-proxy / the kubelet (KUBE-*) or of the cluster's networks."""
    left = []
    for tool in ("iptables-save", "ip6tables-save"):
        r = subprocess.run([tool], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            if (
                "KUBE-" in line
                or "vgpu-cluster" in line
                or "10.201.0." in line
                or "10.202.0." in line
            ):
                left.append(f"{tool}: {line}")
    return left


def cni_host_veths() -> list[str]:
    """Host-side veth names of the cluster's pods, from libcni's result cache."""
    names = []
    for f in Path("/var/lib/cni/results").glob("vgpu-cluster-*"):
        try:
            res = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for i in res.get("result", res).get("interfaces", []):
            if not i.get("sandbox") and i.get("name", "").startswith("veth"):
                names.append(i["name"])
    return names

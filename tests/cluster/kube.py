"""The real cluster of `scripts/cluster`, seen from the tests: kubectl, waits, and the host's state.

Only tests/cluster imports this (tests/README.md: a helper next to the tests of its area).
"""

from __future__ import annotations

import codecs
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sharing.kubequantity import parse_bytes

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

PLUGIN_NS = "vgpu-sharing"  # the plugin's namespace (deploy/base)
POLICY_MAP = "vgpu-sharing-policy"  # the admin policy's ConfigMap (key policy.yaml)

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
        """The pod once its phase is one of `phases`; a timeout, or a pod that ended in a
        phase not asked for (it will not move again), says where it stood."""
        deadline = time.monotonic() + timeout
        pod: Obj = {}
        while time.monotonic() < deadline:
            pod = self.pod(name, namespace)
            phase = pod.get("status", {}).get("phase")
            if phase in phases:
                return pod
            if phase in ("Succeeded", "Failed"):
                timeout = round(timeout - (deadline - time.monotonic()))
                break
            time.sleep(1)
        events = self.kubectl(
            "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
            check=False,
        ).stdout  # fmt: skip
        raise AssertionError(
            f"pod {name} not in {phases} after {timeout}s: "
            f"{json.dumps(pod.get('status'), indent=1)}\nevents:\n{events}"
        )

    def wait_output(self, name: str, timeout: float = 240) -> dict[int, float]:
        """A `claim_pod` pod Running, and what it printed: {GPU index: GiB visible}."""
        self.wait_pod(name, ("Running",), timeout=timeout)
        seen: dict[int, float] = self.wait_until(
            f"{name}'s output", lambda: visible_gib(self.logs(name))
        )
        return seen

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

    def events(self, name: str, namespace: str = "default") -> list[str]:
        """`reason: message` of every Event about the object called `name` (a claim, a pod)."""
        items = self.get(
            "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
        )["items"]
        return [f"{e['reason']}: {e['message']}" for e in items]

    def published_memory(self, device: str) -> int:
        """The `memory` capacity the slices publish for `device` (gpu-<i>), in bytes; -1 if none."""
        for s in self.slices():
            for d in s["spec"].get("devices", []):
                if d["name"] == device:
                    return parse_bytes(d["capacity"]["memory"]["value"])
        return -1

    def wait_until(self, what: str, cond: Any, timeout: float = 120, every: float = 1) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = cond()
            if last:
                return last
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Watch:
    """One collection of the API (a path such as
    /apis/resource.k8s.io/v1/namespaces/default/resourceclaims) listed, then watched from the
    list's resourceVersion with `kubectl get --raw '...?watch=1'` in a thread: `on_event(type,
    object)` gets an ADDED for each object of the list, then every change after it, in order.

    Nothing between the list and the watch is lost and no handshake is needed: the API server
    replays every change after the list's version, however late the watch connects, so whatever
    a test does after `start()` returns is seen. A watch that ends (the server's timeout, a
    broken connection) resumes from the last version seen; one whose version is too old (410
    Gone / Expired) lists again, and the new list's objects come as ADDED (a consumer keyed by
    name takes them as they are).
    """

    def __init__(self, cluster: Cluster, path: str, on_event: Any) -> None:
        self.cluster, self.path, self.on_event = cluster, path, on_event
        self.problems: list[str] = []  # what went wrong in the thread, for assertion messages
        self.relists = 0
        self._rv = ""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"watch {path}")

    def start(self) -> None:
        """List (here, so that a failure is the caller's), then watch in the thread."""
        self._list()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            proc = self._proc
        if proc is not None:
            _end(proc)
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), f"the watch of {self.path} did not stop"

    def _list(self) -> None:
        body = json.loads(self.cluster.kubectl("get", "--raw", self.path).stdout)
        for obj in body.get("items") or []:
            self._deliver("ADDED", obj)
        self._rv = body["metadata"]["resourceVersion"]

    def _deliver(self, kind: str, obj: Obj) -> None:
        try:
            self.on_event(kind, obj)
        except Exception as e:  # kept for the test's message; the watch goes on
            self.problems.append(f"on_event({kind}): {e!r}")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._watch_once() == "expired":
                    self.relists += 1
                    self._list()
                    continue
            except Exception as e:  # a failed list or watch: say so, go again
                self.problems.append(f"{type(e).__name__}: {e}")
            self._stop.wait(0.5)  # the watch ended or failed: not a busy loop

    def _watch_once(self) -> str:
        """Stream events from self._rv until the stream ends: "expired" when the server says
        the version is too old, "ended" otherwise."""
        url = f"{self.path}?watch=1&allowWatchBookmarks=true&resourceVersion={self._rv}"
        # stderr to a file: read once the process is gone, it can neither fill up nor block
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                ["kubectl", "get", "--raw", url],
                stdout=subprocess.PIPE, stderr=err, env=self.cluster.env, bufsize=0,
            )  # fmt: skip
            result = self._stream(proc)
            err.seek(0)
            stderr = err.read().decode(errors="replace")
        if result == "ended" and not self._stop.is_set() and proc.returncode not in (0, None):
            # An expired version answered as an HTTP error rather than as an ERROR event.
            if re.search(r"\b410\b|Expired|too old resource version|Gone", stderr):
                return "expired"
            self.problems.append(f"watch rc={proc.returncode}: {stderr.strip()[-500:]}")
        return result

    def _stream(self, proc: subprocess.Popen[bytes]) -> str:
        """The events of the running watch `proc`, to its end: "expired" or "ended"."""
        with self._lock:
            self._proc = proc
        if self._stop.is_set():  # stop() ran before the process was known to it
            _end(proc)
        assert proc.stdout is not None
        decoder = codecs.getincrementaldecoder("utf-8")()
        buf, result = "", "ended"
        try:
            while chunk := proc.stdout.read(65536):  # unbuffered: what has come
                buf += decoder.decode(chunk)
                events, buf = _json_stream(buf, self.problems)
                for event in events:
                    if self._event(event) == "expired":
                        result = "expired"
                        break
                if result == "expired":
                    break
        finally:
            _end(proc)
            proc.stdout.close()
            with self._lock:
                self._proc = None
        return result

    def _event(self, event: Obj) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410 or obj.get("reason") in ("Expired", "Gone"):
                return "expired"
            self.problems.append(f"watch error: {obj}")
            return "error"
        rv = obj.get("metadata", {}).get("resourceVersion")
        if rv:
            self._rv = rv
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._deliver(kind, obj)
        return "ok"  # BOOKMARK: only its version


def _json_stream(buf: str, problems: list[str]) -> tuple[list[Obj], str]:
    """The whole JSON objects at the start of `buf` (one a line from the API server, but any
    white space between them will do), and what is left: an object not yet complete."""
    decoder = json.JSONDecoder()
    out: list[Obj] = []
    i = 0
    while True:
        while i < len(buf) and buf[i].isspace():
            i += 1
        if i == len(buf):
            return out, ""
        try:
            obj, i = decoder.raw_decode(buf, i)
        except json.JSONDecodeError:
            if buf[i] == "{":
                return out, buf[i:]  # incomplete: wait for the rest
            # Not JSON (nothing else should come on stdout): skip the line, say so.
            nl = buf.find("\n", i)
            if nl < 0:
                return out, buf[i:]
            problems.append(f"not JSON in the watch stream: {buf[i:nl][:200]!r}")
            i = nl + 1
            continue
        if isinstance(obj, dict):
            out.append(obj)


def _end(proc: subprocess.Popen[bytes]) -> None:
    """The watch's kubectl stopped: SIGTERM, then SIGKILL if it lingers; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ClaimRecorder:
    """Every ResourceClaim of a namespace as last seen allocated, and the pods each was ever
    reserved for, from a watch (a list, then the changes from its version on; `Watch`): the
    claims made from a pod's templates are deleted, and a named claim deallocated, as soon as
    the pod is done, which may be well under a second after the allocation, so a test reads them
    from here afterwards. Every version the API server stored is seen, however short-lived."""

    def __init__(self, cluster: Cluster, namespace: str = "default") -> None:
        self.claims: dict[str, Obj] = {}
        self.history: list[str] = []  # every event, one line each, for assertion messages
        self._reserved_for: dict[str, set[str]] = {}  # claim name -> pod UIDs
        self._seen = threading.Condition()
        path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
        self._watch = Watch(cluster, path, self._on_event)

    def __enter__(self) -> ClaimRecorder:
        self._watch.start()  # listed: everything the test does from here on is seen
        return self

    def __exit__(self, *exc: object) -> None:
        self._watch.stop()

    def _on_event(self, kind: str, claim: Obj) -> None:
        meta, status = claim["metadata"], claim.get("status", {})
        users = {r["uid"] for r in status.get("reservedFor", []) if r.get("uid")}
        self.history.append(
            f"{kind} {meta['name']} rv={meta.get('resourceVersion')} "
            f"allocated={bool(status.get('allocation'))} "
            f"reservedFor={[r.get('name') for r in status.get('reservedFor', [])]}"
            + (" deleting" if meta.get("deletionTimestamp") else "")
        )
        with self._seen:
            self._reserved_for.setdefault(meta["name"], set()).update(users)
            if status.get("allocation"):
                self.claims[meta["name"]] = claim
            self._seen.notify_all()

    def claim_of(self, pod: Obj, timeout: float = 30) -> Obj:
        """The allocated claim `pod` ran with (its only claim: from a template, by name, or the
        scheduler's claim for an extended resource), found by the pod's UID in the claim's
        `reservedFor`, not by the name in the pod's status: once the pod is done, the claim
        controller deletes a template's claim and, now and then (a stale cache, seen on 1.37.2
        under load), makes a new one for the finished pod, writes its name into the pod's
        status and deletes it at once; that claim was never allocated. The pod ran, so its
        claim was allocated and reserved before: the timeout only covers the watch's delay."""
        uid = pod["metadata"]["uid"]

        def used() -> list[str]:
            return [n for n in self.claims if uid in self._reserved_for.get(n, set())]

        with self._seen:
            self._seen.wait_for(used, timeout)
            names = used()
            claims = [self.claims[n] for n in names]
        assert len(claims) == 1, (
            f"{len(claims)} allocated claims reserved for pod {pod['metadata']['name']} "
            f"({names}); its status: {pod.get('status', {}).get('resourceClaimStatuses')}; "
            f"watch problems: {self._watch.problems}; events:\n" + "\n".join(self.history)
        )
        return claims[0]


def require_sharing(cluster: Cluster) -> None:
    """Skip, saying why, unless the plugin publishes in sharing mode."""
    if cluster.mode != "sharing":
        pytest.skip(f"the plugin publishes in {cluster.mode} mode on Kubernetes {cluster.version}")


def unschedulable(pod: Obj) -> str:
    """The scheduler's message on a pod it cannot place, or ""."""
    for c in pod.get("status", {}).get("conditions", []):
        if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message"):
            return str(c["message"])
    return ""


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


def claim_pod(
    name: str,
    memory_gi: int | None,
    cores: int,
    gpu_index: int = 0,
    *,
    memory: str | None = None,
    program: str = PROGRAM,
    parameters: dict[str, str] | None = None,
) -> str:
    """A ResourceClaim for a share of GPU `gpu_index` (sharing mode; `memory`, a quantity, in
    place of `memory_gi`) and a pod that runs `program` with Python (by default: prints what it
    sees, `GPU 0: X GiB visible, ...`, and then sleeps). `parameters`: the claim's VgpuConfig
    (apiVersion and kind added)."""
    program = "\n".join("            " + line for line in program.strip().splitlines())
    if memory is None and memory_gi is not None:
        memory = f"{memory_gi}Gi"
    capacity = (
        ""
        if memory is None  # partition mode: one slice, no capacity to ask for
        else f"""          capacity:
            requests:
              memory: "{memory}"
              cores: "{cores}"
"""
    )
    if parameters:
        fields = "".join(f"\n            {k}: {v}" for k, v in parameters.items())
        capacity += f"""    config:
      - requests: ["gpu"]
        opaque:
          driver: {DRIVER}
          parameters:
            apiVersion: vgpu.sharing.dev/v1alpha1
            kind: VgpuConfig{fields}
"""
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


# --- the product's deployment --------------------------------------------------------------------


def rollout(cluster: Cluster, overlay: str) -> None:
    """`kubectl apply -k deploy/overlays/OVERLAY`, then wait for the plugin's DaemonSet."""
    cluster.kubectl("apply", "-k", str(REPO / "deploy" / "overlays" / overlay), timeout=120)
    cluster.kubectl(
        "rollout", "status", "-n", PLUGIN_NS, "daemonset/vgpu-kubelet-plugin", "--timeout=180s",
        timeout=240,
    )  # fmt: skip


def set_policy(cluster: Cluster, text: str) -> None:
    """The admin policy's ConfigMap to `text` (the plugin watches the mounted file)."""
    patch = {"data": {"policy.yaml": text}}
    cluster.kubectl("patch", "configmap", "-n", PLUGIN_NS, POLICY_MAP, "-p", json.dumps(patch))


def policy_text(cluster: Cluster) -> str:
    text: str = cluster.get("configmap", "-n", PLUGIN_NS, POLICY_MAP)["data"]["policy.yaml"]
    return text

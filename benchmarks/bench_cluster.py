"""The product on the real cluster (`scripts/cluster up --with-driver` first): what a claim adds to
a pod's start, how long a claim takes to be prepared, how soon a policy edit is published, and
50 pods sharing 8 simulated GPUs against 50 pods without claims.

    scripts/cluster up --with-driver
    .venv/bin/python benchmarks/bench_cluster.py [--pods 20] [--burst 50] [--edits 5] [--json]

Every figure has its baseline measured in the same run, and the ratio is printed:

- pod start: `create` returned to the pod seen Running (a watch on the namespace), one pod at a
  time, pods with a claim (a ResourceClaimTemplate: 1 GiB, 5 cores) alternating with the same pod
  without one; p50/p99 of each and their ratio;
- claim created to prepared: the claim made from the pod's template seen (ADDED) to its
  allocation (the scheduler) and to the plugin's `status.devices` entry Ready (written after
  NodePrepareResources), for the same pods;
- policy edit: `reservedMemory` of the policy ConfigMap changed; the mounted file changed on the
  host (the kubelet's ConfigMap refresh, on its pod resync: syncFrequency 10 s on scripts/cluster)
  and the new capacity seen in the ResourceSlice (the plugin), each from the edit;
- a burst: the DaemonSet switched to SIM_GPUS=8, 50 pods with a claim (8 GiB, 10 cores each) created
  at once, until all are scheduled and all Running; then 50 pods without a claim; ratio. The
  DaemonSet is set back to its overlay's value afterwards.

Times are wall-clock on the watch's side (monotonic), so they include the API server's and the
watch's delays, the same for both sides of each ratio. Pods run `sleep` in the examples' image.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes import watch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sharing.kubequantity import parse_bytes  # noqa: E402

RUN = Path(os.environ.get("VGPU_CLUSTER_RUN", "/var/lib/vgpu-cluster"))
DRIVER = "vgpu.sharing.dev"
NS = "default"
PLUGIN_NS = "vgpu-sharing"
DS = "vgpu-kubelet-plugin"
POLICY = "vgpu-sharing-policy"
IMAGE = "python:3.12-slim"
GROUP, VERSION = "resource.k8s.io", "v1"


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]


class Seen:
    """Watches pods and claims of NS and the driver's slices; records when each state was first
    seen (time.monotonic())."""

    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.core: Any = kubernetes.client.CoreV1Api(api)
        self.custom: Any = kubernetes.client.CustomObjectsApi(api)
        self.lock = threading.Lock()
        self.running: dict[str, float] = {}
        self.scheduled: dict[str, float] = {}
        self.claim_added: dict[str, float] = {}
        self.claim_allocated: dict[str, float] = {}
        self.claim_prepared: dict[str, float] = {}
        self.claim_pod: dict[str, str] = {}
        self.gpu0_memory: list[tuple[float, int]] = []
        self.devices: set[str] = set()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._loop, args=(self._pods,), daemon=True),
            threading.Thread(target=self._loop, args=(self._claims,), daemon=True),
            threading.Thread(target=self._loop, args=(self._slices,), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _loop(self, body: Callable[[], None]) -> None:
        while not self.stop.is_set():
            try:
                body()
            except Exception as e:  # a dropped watch: start again
                print(f"  (watch restarted: {type(e).__name__})", file=sys.stderr)
                time.sleep(0.5)

    def _pods(self) -> None:
        w: Any = watch.Watch()  # type: ignore[no-untyped-call]
        for ev in w.stream(self.core.list_namespaced_pod, NS, timeout_seconds=60):
            now = time.monotonic()
            pod = ev["object"]
            name = pod.metadata.name
            with self.lock:
                if pod.status.phase == "Running":
                    self.running.setdefault(name, now)
                for c in pod.status.conditions or []:
                    if c.type == "PodScheduled" and c.status == "True":
                        self.scheduled.setdefault(name, now)
            if self.stop.is_set():
                return

    def _claims(self) -> None:
        w: Any = watch.Watch()  # type: ignore[no-untyped-call]
        for ev in w.stream(
            self.custom.list_namespaced_custom_object, GROUP, VERSION, NS, "resourceclaims",
            timeout_seconds=60,
        ):  # fmt: skip
            now = time.monotonic()
            c = ev["object"]
            name = c["metadata"]["name"]
            status = c.get("status", {})
            with self.lock:
                self.claim_added.setdefault(name, now)
                for o in c["metadata"].get("ownerReferences", []):
                    if o.get("kind") == "Pod":
                        self.claim_pod[name] = o["name"]
                if status.get("allocation"):
                    self.claim_allocated.setdefault(name, now)
                for d in status.get("devices", []):
                    if any(x["type"] == "Ready" and x["status"] == "True"
                           for x in d.get("conditions", [])):  # fmt: skip
                        self.claim_prepared.setdefault(name, now)
            if self.stop.is_set():
                return

    def _slices(self) -> None:
        w: Any = watch.Watch()  # type: ignore[no-untyped-call]
        for ev in w.stream(
            self.custom.list_cluster_custom_object, GROUP, VERSION, "resourceslices",
            timeout_seconds=60,
        ):  # fmt: skip
            now = time.monotonic()
            s = ev["object"]
            if s["spec"].get("driver") != DRIVER or ev["type"] == "DELETED":
                continue
            with self.lock:
                for d in s["spec"].get("devices", []):
                    self.devices.add(d["name"])
                    if d["name"] == "gpu-0" and "capacity" in d:
                        mem = parse_bytes(d["capacity"]["memory"]["value"])
                        if not self.gpu0_memory or self.gpu0_memory[-1][1] != mem:
                            self.gpu0_memory.append((now, mem))
            if self.stop.is_set():
                return

    def wait(self, what: str, cond: Callable[[], bool], timeout: float = 300) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if cond():
                    return time.monotonic()
            time.sleep(0.02)
        raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


def pod_manifest(name: str, claim: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "c", "image": IMAGE, "command": ["sleep", "3600"]}],
    }
    if claim:
        spec["securityContext"] = {"seccompProfile": {"type": "RuntimeDefault"}}
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "bench-gpu"}]
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"bench": "cluster"}}, "spec": spec}  # fmt: skip


def template(memory: str, cores: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "bench-gpu"},
        "spec": {"spec": {"devices": {"requests": [{
            "name": "gpu",
            "exactly": {"deviceClassName": DRIVER,
                        "capacity": {"requests": {"memory": memory, "cores": str(cores)}}},
        }]}}},
    }  # fmt: skip


def set_template(seen: Seen, memory: str, cores: int) -> None:
    try:
        seen.custom.delete_namespaced_custom_object(
            GROUP, VERSION, NS, "resourceclaimtemplates", "bench-gpu"
        )
    except kubernetes.client.ApiException as e:
        if e.status != 404:
            raise
    seen.custom.create_namespaced_custom_object(
        GROUP, VERSION, NS, "resourceclaimtemplates", template(memory, cores)
    )


def delete_pods(seen: Seen) -> None:
    seen.core.delete_collection_namespaced_pod(
        NS, label_selector="bench=cluster", grace_period_seconds=0
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        pods = seen.core.list_namespaced_pod(NS, label_selector="bench=cluster").items
        claims = seen.custom.list_namespaced_custom_object(GROUP, VERSION, NS, "resourceclaims")
        if not pods and not claims["items"]:
            return
        time.sleep(0.5)
    raise RuntimeError("the benchmark's pods or claims are still there after 300 s")


def start_latency(seen: Seen, n: int) -> dict[str, Any]:
    set_template(seen, "1Gi", 5)
    with_claim: list[float] = []
    without: list[float] = []
    for i in range(n + 1):  # the first pair warms up
        order = [True, False] if i % 2 == 0 else [False, True]
        for claim in order:
            name = f"start-{'claim' if claim else 'plain'}-{i}"
            t = time.monotonic()
            seen.core.create_namespaced_pod(NS, pod_manifest(name, claim))
            done = seen.wait(f"{name} Running", lambda: name in seen.running)  # noqa: B023
            if i > 0:
                (with_claim if claim else without).append(done - t)
    with seen.lock:
        allocated: list[float] = []
        prepared: list[float] = []
        for claim_name, pod in seen.claim_pod.items():
            if not pod.startswith("start-claim-") or pod.endswith("-0"):
                continue
            a = seen.claim_added[claim_name]
            allocated.append(seen.claim_allocated[claim_name] - a)
            prepared.append(seen.claim_prepared[claim_name] - a)
    delete_pods(seen)
    return {
        "pods": n,
        "with_claim_p50_s": pct(with_claim, 50), "with_claim_p99_s": pct(with_claim, 99),
        "without_p50_s": pct(without, 50), "without_p99_s": pct(without, 99),
        "claim_allocated_p50_s": pct(allocated, 50), "claim_allocated_p99_s": pct(allocated, 99),
        "claim_prepared_p50_s": pct(prepared, 50), "claim_prepared_p99_s": pct(prepared, 99),
    }  # fmt: skip


def policy_file(seen: Seen) -> Path:
    [pod] = seen.core.list_namespaced_pod(
        PLUGIN_NS, label_selector="app.kubernetes.io/name=vgpu-kubelet-plugin"
    ).items
    return Path(
        f"/var/lib/kubelet/pods/{pod.metadata.uid}/volumes/kubernetes.io~configmap/policy/policy.yaml"
    )


def policy_edits(seen: Seen, edits: int) -> dict[str, Any]:
    cm = seen.core.read_namespaced_config_map(POLICY, PLUGIN_NS)
    original = cm.data["policy.yaml"]
    doc = yaml.safe_load(original)
    base = parse_bytes(doc["default"]["reservedMemory"])
    path = policy_file(seen)
    kubelet: list[float] = []
    published: list[float] = []
    current = base
    try:
        for _ in range(edits):
            new = base + (1 << 30) if current == base else base
            with seen.lock:
                want = seen.gpu0_memory[-1][1] - (new - current)
            doc["default"]["reservedMemory"] = f"{new >> 20}Mi"
            text = yaml.safe_dump(doc)
            t0 = time.monotonic()
            seen.core.patch_namespaced_config_map(
                POLICY, PLUGIN_NS, {"data": {"policy.yaml": text}}
            )
            t1 = 0.0
            while not t1 and time.monotonic() - t0 < 300:
                try:
                    if path.read_text() == text:
                        t1 = time.monotonic()
                except OSError:  # the kubelet swaps the ..data link
                    pass
                time.sleep(0.01)
            if not t1:
                raise RuntimeError(f"{path} not updated after 300 s")
            seen.wait("the new capacity published", lambda: seen.gpu0_memory[-1][1] == want)  # noqa: B023
            with seen.lock:
                t2 = next(t for t, m in reversed(seen.gpu0_memory) if m == want)
            kubelet.append(t1 - t0)
            published.append(t2 - t0)
            current = new
    finally:
        seen.core.patch_namespaced_config_map(
            POLICY, PLUGIN_NS, {"data": {"policy.yaml": original}}
        )
    plugin = [p - k for p, k in zip(published, kubelet, strict=True)]
    return {
        "edits": edits,
        "file_p50_s": statistics.median(kubelet), "file_max_s": max(kubelet),
        "published_p50_s": statistics.median(published), "published_max_s": max(published),
        "plugin_p50_s": statistics.median(plugin), "plugin_max_s": max(plugin),
    }  # fmt: skip


def set_sim_gpus(seen: Seen, n: int) -> None:
    apps: Any = kubernetes.client.AppsV1Api(seen.core.api_client)
    patch = {"spec": {"template": {"spec": {"containers": [
        {"name": "plugin", "env": [{"name": "SIM_GPUS", "value": str(n)}]}]}}}}  # fmt: skip
    apps.patch_namespaced_daemon_set(DS, PLUGIN_NS, patch)
    want = {f"gpu-{i}" for i in range(n)}

    def ready() -> bool:
        ds = apps.read_namespaced_daemon_set(DS, PLUGIN_NS)
        st = ds.status
        return bool(
            st.observed_generation == ds.metadata.generation
            and st.updated_number_scheduled == st.desired_number_scheduled == st.number_ready
        )

    deadline = time.monotonic() + 300
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.5)
    custom: Any = seen.custom

    def published() -> set[str]:
        items = custom.list_cluster_custom_object(GROUP, VERSION, "resourceslices")["items"]
        return {d["name"] for s in items if s["spec"]["driver"] == DRIVER
                for d in s["spec"].get("devices", [])}  # fmt: skip

    while published() != want and time.monotonic() < deadline:
        time.sleep(0.5)
    if published() != want:
        raise RuntimeError(f"slices publish {sorted(published())}, not {sorted(want)}")


def burst(seen: Seen, n: int, claim: bool) -> tuple[float, float]:
    names = [f"burst-{'claim' if claim else 'plain'}-{i}" for i in range(n)]
    t = time.monotonic()
    for name in names:
        seen.core.create_namespaced_pod(NS, pod_manifest(name, claim))
    scheduled = seen.wait(f"{n} pods scheduled",
                          lambda: all(x in seen.scheduled for x in names), 600)  # fmt: skip
    running = seen.wait(f"{n} pods Running", lambda: all(x in seen.running for x in names), 900)
    delete_pods(seen)
    return scheduled - t, running - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=20, help="pods of each kind for the start latency")
    ap.add_argument("--burst", type=int, default=50, help="pods of each kind at once")
    ap.add_argument("--edits", type=int, default=5, help="policy edits")
    ap.add_argument("--gpus", type=int, default=8, help="simulated GPUs for the burst")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    kubeconfig = RUN / "admin.kubeconfig"
    if not kubeconfig.exists():
        print(f"no cluster: {kubeconfig} is missing (scripts/cluster up --with-driver)")
        return 2
    api = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig)
    )
    seen = Seen(api)
    seen.wait("the slices", lambda: bool(seen.gpu0_memory), 60)
    load = os.getloadavg()[0]
    out: dict[str, Any] = {}
    try:
        out["start"] = start_latency(seen, args.pods)
        out["policy"] = policy_edits(seen, args.edits)
        original_gpus = len([d for d in seen.devices if d.startswith("gpu-")])
        set_sim_gpus(seen, args.gpus)
        try:
            set_template(seen, "8Gi", 10)
            c_sched, c_run = burst(seen, args.burst, claim=True)
            p_sched, p_run = burst(seen, args.burst, claim=False)
        finally:
            set_sim_gpus(seen, original_gpus)
        out["burst"] = {"pods": args.burst, "gpus": args.gpus,
                        "claim_scheduled_s": c_sched, "claim_running_s": c_run,
                        "plain_scheduled_s": p_sched, "plain_running_s": p_run}  # fmt: skip
    finally:
        seen.stop.set()
        with contextlib.suppress(kubernetes.client.ApiException):
            seen.custom.delete_namespaced_custom_object(
                GROUP, VERSION, NS, "resourceclaimtemplates", "bench-gpu"
            )
    out["load_before"] = load
    out["load_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out))
        return 0
    s, p, b = out["start"], out["policy"], out["burst"]
    print(f"real cluster (scripts/cluster), load average {load:.1f} before, "
          f"{out['load_after']:.1f} after")  # fmt: skip
    print(f"pod start to Running, {s['pods']} pods each, one at a time")
    print(
        f"  with a claim     p50 {s['with_claim_p50_s']:.2f} s   p99 {s['with_claim_p99_s']:.2f} s"
    )
    print(f"  without          p50 {s['without_p50_s']:.2f} s   p99 {s['without_p99_s']:.2f} s")
    print(f"  ratio            p50 x{s['with_claim_p50_s'] / s['without_p50_s']:.2f}   "
          f"p99 x{s['with_claim_p99_s'] / s['without_p99_s']:.2f}")  # fmt: skip
    print("claim created (from the pod's template) to")
    print(f"  allocated        p50 {s['claim_allocated_p50_s']:.2f} s   "
          f"p99 {s['claim_allocated_p99_s']:.2f} s")  # fmt: skip
    print(f"  prepared         p50 {s['claim_prepared_p50_s']:.2f} s   "
          f"p99 {s['claim_prepared_p99_s']:.2f} s (status.devices Ready)")  # fmt: skip
    print(f"policy edit ({p['edits']} edits of reservedMemory), from the ConfigMap patch")
    print(f"  file on the node median {p['file_p50_s']:.2f} s, max {p['file_max_s']:.2f} s "
          "(the kubelet)")  # fmt: skip
    print(f"  slice published  median {p['published_p50_s']:.2f} s, max "
          f"{p['published_max_s']:.2f} s")  # fmt: skip
    print(f"  of which plugin  median {p['plugin_p50_s']:.2f} s, max {p['plugin_max_s']:.2f} s "
          "(file changed to slice seen)")  # fmt: skip
    print(f"{b['pods']} pods at once, {b['gpus']} simulated GPUs")
    print(f"  with claims      all scheduled {b['claim_scheduled_s']:.2f} s, all Running "
          f"{b['claim_running_s']:.2f} s")  # fmt: skip
    print(f"  without          all scheduled {b['plain_scheduled_s']:.2f} s, all Running "
          f"{b['plain_running_s']:.2f} s")  # fmt: skip
    print(f"  ratio            scheduled x{b['claim_scheduled_s'] / b['plain_scheduled_s']:.2f}, "
          f"Running x{b['claim_running_s'] / b['plain_running_s']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

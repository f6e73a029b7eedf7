"""The `namespace`, `pod` and `container` labels, named by the kubelet: the exporter asks a stand-in
kubelet's PodResources API (real gRPC on a unix socket) which containers hold each claim, and
tells the containers of a claim apart by the kubelet's per-container mount in each process
(real processes, each in its own mount namespace with that bind mount, as the kubelet makes it).
"""

from __future__ import annotations

import filecmp
import json
import logging
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sharing.observe.exporter import Exporter, ExporterConfig
from sharing.observe.nvml_reader import GpuProcess, GpuReading, NvmlReading
from tests.fakes.podresources import Held, PodResourcesStandin
from tests.support.observers import MiB, Sample, add_claim, only, scrape, scrape_until

GiB = 1 << 30
UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
OURS = "k8s.vgpu.sharing.dev/claim"
TOOLKIT = "nvidia.com/gpu=0"  # NVIDIA's CDI device: every claim on GPU 0 has it


class Procs:
    """Processes holding a claim's accounting file open, optionally with the kubelet's
    per-container file bind-mounted (a mount namespace of their own)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.used: dict[int, int] = {}  # pid -> bytes NVML says it holds
        self._procs: list[subprocess.Popen[str]] = []

    def start(self, accounting: Path, used: int, pod_uid: str = "", name: str = "") -> int:
        script = f'exec 3<"{accounting}"; '
        if name:
            src = self.root / "kubelet" / "pods" / pod_uid / "containers" / name / "0a1b2c3d"
            src.parent.mkdir(parents=True, exist_ok=True)
            src.touch()
            dst = self.root / f"termination-log-{len(self._procs)}"
            dst.touch()
            script += f'mount --bind "{src}" "{dst}" || exit 1; '
        script += "echo ready; exec sleep 600"
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line == "ready\n", (line, p.stderr.read() if p.stderr else "")
        self.used[p.pid] = used
        return p.pid

    def reading(self) -> NvmlReading:
        procs = tuple(GpuProcess(pid, n) for pid, n in self.used.items())
        g = GpuReading(0, UUID0, "NVIDIA H100 80GB HBM3", "00000000:00:00.0", True, 80 * GiB,
                       GiB, 0.5, procs)  # fmt: skip
        r = NvmlReading(taken=time.monotonic(), gpus=(g,))
        r.by_uuid[UUID0] = g
        return r

    def stop(self) -> None:
        for p in self._procs:
            p.kill()
            p.communicate(timeout=30)


def _can_unshare() -> str:
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    r = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    return "" if r.returncode == 0 else f"cannot make a mount namespace: {r.stderr.strip()}"


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vgpr", dir="/tmp"))  # short: unix socket paths
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _claim(data: Path, uid: str, name: str) -> Path:
    """A prepared claim whose checkpoint lists its own CDI device and NVIDIA's."""
    shared = add_claim(data, uid, name, UUID0, 4 * GiB, 30, ns="team", device=("node-a", "gpu-0"))
    ck = data / "checkpoint.json"
    doc = json.loads(ck.read_text())
    doc["claims"][uid]["devices"][0]["cdi_device_ids"].append(TOOLKIT)
    ck.write_text(json.dumps(doc))
    return shared / "accounting"


def _serve(data: Path, procs: Procs, socket: Path) -> tuple[Exporter, str]:
    cfg = ExporterConfig(data_dir=data, hostname="node-a", cache_seconds=0, nvml_interval=0.2,
                         pod_resources_socket=str(socket))  # fmt: skip
    exp = Exporter(cfg, nvml_reader=procs.reading)
    host, port = exp.start("127.0.0.1", 0)
    return exp, f"http://{host}:{port}"


def _containers(s: list[Sample], name: str, claim_uid: str) -> dict[str, dict[str, str]]:
    return {x.labels["container"]: x.labels for x in only(s, name, claim_uid=claim_uid)}


def test_pod_and_container_names_come_from_the_kubelet(root: Path) -> None:
    if why := _can_unshare():
        pytest.skip(why)
    data = root / "data"
    data.mkdir()
    train = _claim(data, "uid-train", "train")  # one container: train-0/main
    shared = _claim(data, "uid-shared", "shared")  # two containers of web-0: app and sidecar
    web_uid = str(uuid.uuid4())
    procs = Procs(root)
    kubelet = PodResourcesStandin(root / "kubelet.sock").start()
    kubelet.put(
        Held("team", "train-0", "main", "train", (f"{OURS}=uid-train", TOOLKIT)),
        Held("team", "web-0", "app", "shared", (f"{OURS}=uid-shared", TOOLKIT)),
        Held("team", "web-0", "sidecar", "shared", (f"{OURS}=uid-shared", TOOLKIT)),
        Held("other", "idle-0", "main", "idle", ("k8s.vgpu.sharing.dev/claim=uid-idle",)),
    )
    exp = None
    try:
        procs.start(train, 300 * MiB)  # no kubelet mount: the claim's only container
        procs.start(shared, 100 * MiB, web_uid, "app")
        procs.start(shared, 50 * MiB, web_uid, "app")
        procs.start(shared, 700 * MiB, web_uid, "sidecar")
        exp, url = _serve(data, procs, kubelet.socket)
        assert exp.pod_resources is not None and exp.pod_resources.read()

        def named(s: list[Sample]) -> bool:
            return set(_containers(s, "vgpu_container_memory_used_bytes", "uid-shared")) == {
                "app",
                "sidecar",
            } and bool(_containers(s, "vgpu_container_memory_used_bytes", "uid-train"))

        s = scrape_until(url, named)
    finally:
        if exp is not None:
            exp.stop()
        procs.stop()
        kubelet.stop()
    assert kubelet.lists >= 1
    # slice series: the claim's pod and the names of its containers
    [tl] = [x.labels for x in only(s, "vgpu_slice_memory_limit_bytes", claim_uid="uid-train")]
    assert (tl["namespace"], tl["pod"], tl["container"]) == ("team", "train-0", "main")
    [sl] = [x.labels for x in only(s, "vgpu_slice_memory_limit_bytes", claim_uid="uid-shared")]
    assert (sl["namespace"], sl["pod"], sl["container"]) == ("team", "web-0", "app,sidecar")
    # container series: each container by its name, its processes' memory summed
    ours = only(s, "vgpu_container_memory_used_bytes", claim_uid="uid-shared")
    assert {(x.labels["pod"], x.labels["container"]): x.value for x in ours} == {
        ("web-0", "app"): 150 * MiB,
        ("web-0", "sidecar"): 700 * MiB,
    }
    [t] = only(s, "vgpu_container_memory_used_bytes", claim_uid="uid-train")
    assert (t.labels["pod"], t.labels["container"], t.value) == ("train-0", "main", 300 * MiB)
    assert t.labels["dra_claim_name"] == "train" and t.labels["namespace"] == "team"
    hami = only(s, "hami_vgpu_memory_used_bytes", claim_uid="uid-shared")
    assert {(h.labels["namespace"], h.labels["pod"], h.labels["container"]): h.value
            for h in hami} == {("team", "web-0", "app"): 150 * MiB,
                               ("team", "web-0", "sidecar"): 700 * MiB}  # fmt: skip
    limits = only(s, "hami_vgpu_memory_limit_bytes", claim_uid="uid-train")
    assert [(h.labels["pod"], h.labels["container"], h.value) for h in limits] == [
        ("train-0", "main", 4 * GiB)
    ]


def test_without_the_kubelet_socket_the_names_stay_empty(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No socket: the labels are empty, one log line says why, every scrape still answers."""
    data = root / "data"
    data.mkdir()
    _claim(data, "uid-train", "train")
    procs = Procs(root)
    with caplog.at_level(logging.INFO, logger="sharing.observe.podresources"):
        exp, url = _serve(data, procs, root / "absent.sock")
        try:
            assert exp.pod_resources is not None
            for _ in range(3):
                assert not exp.pod_resources.read()
                s = scrape(url)
        finally:
            exp.stop()
    [sl] = [x.labels for x in only(s, "vgpu_slice_memory_limit_bytes", claim_uid="uid-train")]
    assert (sl["namespace"], sl["pod"], sl["container"]) == ("team", "", "")
    lines = [r.getMessage() for r in caplog.records if r.name == "sharing.observe.podresources"]
    assert len(lines) == 1, lines
    assert "PodResources API unavailable" in lines[0] and "absent.sock" in lines[0], lines


def test_the_kubelet_going_away_and_coming_back(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A kubelet that stops answering keeps the last names (no flapping series); one line when
    it goes, one when it is back."""
    data = root / "data"
    data.mkdir()
    _claim(data, "uid-train", "train")
    sock = root / "kubelet.sock"
    held = Held("team", "train-0", "main", "train", (f"{OURS}=uid-train",))
    procs = Procs(root)
    first = PodResourcesStandin(sock).start()
    first.put(held)
    exp, url = _serve(data, procs, sock)
    assert exp.pod_resources is not None
    try:
        with caplog.at_level(logging.INFO, logger="sharing.observe.podresources"):
            assert exp.pod_resources.read()
            first.stop()
            assert not exp.pod_resources.read()  # the server is gone, its socket file too
            assert not exp.pod_resources.read()
            s = scrape(url)
            [sl] = [x.labels for x in only(s, "vgpu_slice_memory_limit_bytes")]
            assert (sl["pod"], sl["container"]) == ("train-0", "main")
            with PodResourcesStandin(sock) as kubelet:
                kubelet.put()  # the pod is gone
                assert exp.pod_resources.read()
            s = scrape(url)
    finally:
        exp.stop()
        first.stop()
    [sl] = [x.labels for x in only(s, "vgpu_slice_memory_limit_bytes")]
    assert (sl["pod"], sl["container"]) == ("", "")
    lines = [r.getMessage() for r in caplog.records if r.name == "sharing.observe.podresources"]
    assert len(lines) == 2, lines
    assert "unavailable" in lines[0] and "answers again" in lines[1], lines


def test_generated_code_is_current_and_speaks_the_kubelets_method(tmp_path: Path) -> None:
    """Regenerating sharing/observe/proto gives byte-identical modules; the method path is the kubelet's."""
    from sharing.observe.proto import podresources_v1_pb2
    from sharing.observe.proto.generate import PROTO_DIR, PROTOS, generate

    written = generate(tmp_path)
    assert len(written) == 2 * len(PROTOS)
    for path in written:
        assert filecmp.cmp(path, PROTO_DIR / path.name, shallow=False), f"{path.name}: regenerate"
    svc = podresources_v1_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert svc.full_name == "v1.PodResourcesLister"
    assert {m.name for m in svc.methods} == {"List", "Get", "GetAllocatableResources"}

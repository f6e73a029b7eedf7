"""C programs on the CUDA driver API inside pods, as a CUDA application is built: linked against
libcuda.so.1, in an image built here (the product's image, which has glibc 2.36 like this
machine, plus tests/c/e2e_claim_quota and tests/c/compute_workload), loaded into the cluster's
containerd. The claim's CDI spec gives them the simulated driver and the shim.

- The quota: a 2 GiB share shows 2 GiB; 3 GiB is refused with CUDA_ERROR_OUT_OF_MEMORY, 1 GiB
  is granted.
- PyTorch (.venv/frameworks' CUDA 13 build, mounted read-only from the host into the example
  image, whose Python is also 3.11: copying its 5.7 GB into an image would cost minutes) sees
  its 2 GiB share, its caching allocator runs out of memory at the quota, and cuBLAS works once
  the memory is freed.
- The compute cap: kernels launched back to back get at most about their claim's cores (20 %),
  while a claim of every core (100) gets the device, both measured by the simulator's own count
  of the device time each process was served (tests/shim_compute's bounds: the cap is an upper
  bound always judged; a lower bound only where the host let the program run).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.kube import CACHE, DRIVER, RUN, Cluster, require_sharing
from tests.support.cbuild import compile_program
from tests.support.clients import frameworks_python
from tests.support.compute_workload import at_least, parse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

IMAGE = "localhost/vgpu-cuda-programs:test"
BASE = "localhost/vgpu-sharing:0.1.0"  # scripts/cluster's image, already in podman's store
CTR = CACHE / "containerd-2.4.2" / "bin" / "ctr"
CUDA_ERROR_OUT_OF_MEMORY = 2


def _run(cmd: list[str], timeout: float = 300) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}: rc={r.returncode}\n{r.stdout[-2000:]}{r.stderr}"


@pytest.fixture(scope="module")
def image(cluster: Cluster) -> Iterator[str]:
    """The programs in an image in containerd's k8s.io namespace (nothing is pulled)."""
    require_sharing(cluster)  # not built where every test of the module skips
    with tempfile.TemporaryDirectory(prefix="vgpu-cuda-image-") as d:
        ctx = Path(d)
        for src in ("e2e_claim_quota.c", "compute_workload.c"):
            exe = compile_program(src, ctx)
            exe.rename(ctx / src.removesuffix(".c"))
        (ctx / "Containerfile").write_text(
            f"FROM {BASE}\nCOPY e2e_claim_quota compute_workload /usr/local/bin/\nENTRYPOINT []\n"
        )
        _run(["podman", "build", "--runtime", "/usr/sbin/runc", "-t", IMAGE, str(ctx)])
        tar = ctx / "image.tar"
        _run(["podman", "save", "--format", "docker-archive", "-o", str(tar), IMAGE])
        _run([str(CTR), "--address", str(RUN / "containerd" / "containerd.sock"),
              "-n", "k8s.io", "images", "import", str(tar)])  # fmt: skip
    yield IMAGE


def _pod(name: str, memory_gi: int, cores: int, command: str, gpu: int = 1) -> str:
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: default}}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: {DRIVER}
          selectors:
            - cel: {{expression: 'device.attributes["{DRIVER}"].index == {gpu}'}}
          capacity: {{requests: {{memory: {memory_gi}Gi, cores: "{cores}"}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  securityContext: {{seccompProfile: {{type: RuntimeDefault}}}}
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  resourceClaims:
    - {{name: gpu, resourceClaimName: {name}}}
  containers:
    - name: cuda
      image: {IMAGE}
      command: ["sh", "-c", "{command}"]
      resources: {{claims: [{{name: gpu}}]}}
"""


def _finished(cluster: Cluster, name: str) -> str:
    pod = cluster.wait_pod(name, ("Succeeded", "Failed"), timeout=240)
    log = cluster.logs(name)
    assert pod["status"]["phase"] == "Succeeded", (pod["status"], log)
    return log


def test_a_c_program_is_refused_past_its_share(clean_default: Cluster, image: str) -> None:
    cluster = clean_default
    require_sharing(cluster)
    command = (
        f"e2e_claim_quota info && e2e_claim_quota alloc {3 << 30} && "
        f"e2e_claim_quota alloc {1 << 30}"
    )
    cluster.apply(_pod("c-quota", 2, 10, command))
    log = _finished(cluster, "c-quota")
    print(f"\n=== {log.strip()}")
    assert f"total={2 << 30} " in log, log
    allocs = [line for line in log.splitlines() if line.startswith("alloc=")]
    assert allocs == [f"alloc={CUDA_ERROR_OUT_OF_MEMORY}", "alloc=0"], log


def test_a_c_program_is_held_to_its_cores(clean_default: Cluster, image: str) -> None:
    cluster = clean_default
    require_sharing(cluster)
    run = "compute_workload --warmup 0.5 --seconds 3"
    cluster.apply(_pod("c-capped", 4, 20, run, gpu=1))
    cluster.apply(_pod("c-whole", 4, 100, run, gpu=0))
    capped = parse(_finished(cluster, "c-capped"), "", 0)
    whole = parse(_finished(cluster, "c-whole"), "", 0)
    print(f"\n=== cores 20: {capped.stdout.strip()}\n=== cores 100: {whole.stdout.strip()}")
    assert capped.share < 30 and at_least(capped, 8), capped.stdout
    assert at_least(whole, 60), whole.stdout


TORCH = """
import torch
print("devices", torch.cuda.is_available(), torch.cuda.device_count(), flush=True)
free, total = torch.cuda.mem_get_info()
print(f"total={total}", flush=True)
held = []
try:
    while True:
        held.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
except torch.cuda.OutOfMemoryError:
    print(f"oom after={len(held) * (64 << 20)}", flush=True)
del held
torch.cuda.empty_cache()
a = torch.ones(256, 256, device="cuda")
print("matmul", tuple((a @ a).shape), flush=True)
"""


def _site_packages() -> str:
    """.venv/frameworks' site-packages, when its Python is the image's 3.11."""
    python = frameworks_python("torch")
    out = subprocess.run(
        [python, "-c", "import json, sys, sysconfig; "
         "print(json.dumps([sys.version_info[:2], sysconfig.get_paths()['purelib']]))"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    version, purelib = json.loads(out)
    if version != [3, 11]:
        pytest.skip(f".venv/frameworks runs Python {version}; the image's python3 is 3.11")
    return str(purelib)


def test_pytorch_in_a_pod_sees_and_stops_at_its_share(clean_default: Cluster) -> None:
    cluster = clean_default
    require_sharing(cluster)
    site = _site_packages()
    program = "\n".join("          " + line for line in TORCH.strip().splitlines())
    manifest = (
        _pod("torch-share", 2, 50, "true")
        .replace(
            f"""      image: {IMAGE}
      command: ["sh", "-c", "true"]
""",
            f"""      image: python:3.12-slim
      env: [{{name: PYTHONPATH, value: /opt/frameworks}}]
      volumeMounts: [{{name: frameworks, mountPath: /opt/frameworks, readOnly: true}}]
      command: ["python3", "-c"]
      args:
        - |
{program}
""",
        )
        .replace(
            "  containers:\n",
            f"  volumes: [{{name: frameworks, hostPath: {{path: {site}, type: Directory}}}}]\n"
            "  containers:\n",
        )
    )
    cluster.apply(manifest)
    log = _finished(cluster, "torch-share")
    print(f"\n=== {log.strip()}")
    assert "devices True 1" in log, log
    assert f"total={2 << 30}" in log, log
    [oom] = [int(x.split("=")[1]) for x in log.split() if x.startswith("after=")]
    assert (1 << 30) < oom <= (2 << 30), log
    assert "matmul (256, 256)" in log, log

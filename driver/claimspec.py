"""A claim's CDI spec: one device named by the claim UID carrying every GPU of the claim (its
device nodes, the shim and its preload list, the limits file, the slice's accounting and demand
files, the device metadata files, the environment tools read) plus the driver's files on CDI-only runtimes
(driver/injection.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cdi.spec import ContainerEdits, Device, DeviceNode, Mount, Spec
from driver.claimfiles import ClaimFiles, HostPaths
from driver.claims import ClaimPlan, GpuLimit
from driver.devicemetadata import MetadataFile
from driver.injection import NO_INJECTION, Injection
from driver.injection import apply as apply_injection
from sharing.claimlayout import (
    CONTAINER_ACCOUNTING,
    CONTAINER_BURST_POOL,
    CONTAINER_DEMAND_FILE,
    CONTAINER_LIB,
    CONTAINER_LIMITS,
    CONTAINER_NODE_STATE_DIR,
    CONTAINER_PRELOAD,
)

_RO = ("ro", "nosuid", "nodev", "bind")
_RW = ("rw", "nosuid", "nodev", "bind")


def build_spec(
    kind: str,
    plan: ClaimPlan,
    limits: Sequence[GpuLimit],
    files: ClaimFiles,
    paths: HostPaths,
    inj: Injection = NO_INJECTION,
    metadata: Sequence[MetadataFile] = (),
    burst_pool: Path | None = None,
) -> Spec:
    """limits: the plan's gpu_limits(); burst_pool: the node's pool file, mounted read-only when
    the claim bursts (docs/policy.md)."""
    uuids = ",".join(g.gpu.uuid for g in limits)
    env: list[tuple[str, str]] = [
        ("CUDA_VISIBLE_DEVICES", uuids),
        ("NVIDIA_VISIBLE_DEVICES", uuids),
    ]
    # Indices as the container sees them: positions in CUDA_VISIBLE_DEVICES. For tools that
    # read them; the shim takes its limits from the limits file.
    for i, g in enumerate(limits):
        env.append((f"CUDA_DEVICE_MEMORY_LIMIT_{i}", str(g.memory_limit)))
        env.append((f"CUDA_DEVICE_SM_LIMIT_{i}", str(g.sm_limit)))
    env += [
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", CONTAINER_ACCOUNTING),
        ("VGPU_COMPUTE_POLICY", plan.config.compute_policy),
        ("VGPU_PRIORITY", str(plan.config.priority)),
        ("VGPU_NODE_STATE_DIR", CONTAINER_NODE_STATE_DIR),
        ("VGPU_DEMAND_FILE", CONTAINER_DEMAND_FILE),
    ]
    mounts = (
        Mount(str(paths.shim_library), CONTAINER_LIB, _RO),
        Mount(str(files.limits), CONTAINER_LIMITS, _RO),
        Mount(str(paths.preload_file), CONTAINER_PRELOAD, _RO),
        # the accounting file alone: a tenant cannot create files on the host or rename it
        Mount(str(files.accounting), CONTAINER_ACCOUNTING, _RW),
        Mount(str(paths.node_state_dir), CONTAINER_NODE_STATE_DIR, _RO),
        Mount(str(files.demand), CONTAINER_DEMAND_FILE, _RW),
        # the device metadata of each request (KEP-5304), each file alone and read-only
        *(Mount(str(files.metadata(m.request)), m.container_path, _RO) for m in metadata),
        # the node's burst pool, alone and read-only: the shim reads the claim's grant from it
        *([Mount(str(burst_pool), CONTAINER_BURST_POOL, _RO)] if burst_pool is not None else []),
    )
    nodes: list[DeviceNode] = []
    names = [f"nvidia{g.gpu.minor}" for g in limits] + ["nvidiactl", "nvidia-uvm"]
    for n in names:
        host = paths.dev_root / n
        if host.exists():  # no GPU (or no UVM module) on this host: nothing to expose
            nodes.append(DeviceNode(path=f"/dev/{n}", host_path=str(host)))
    edits = ContainerEdits(env=tuple(env), device_nodes=tuple(nodes), mounts=mounts)
    edits = apply_injection(edits, inj)
    return Spec(kind=kind, devices=(Device(name=plan.ref.uid, edits=edits),))

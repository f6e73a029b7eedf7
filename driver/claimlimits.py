"""A claim's limits file text (sharing/limitsfile.py's format) from its plan: the per-GPU
limits in container device order, the compute policy and priority, and the container paths of
the slice's shared files."""

from __future__ import annotations

from collections.abc import Sequence

from driver.checkpoint import ClaimMemory
from driver.claims import ClaimPlan, GpuLimit
from sharing.claimlayout import (
    CONTAINER_ACCOUNTING,
    CONTAINER_BURST_POOL,
    CONTAINER_DEMAND_FILE,
    CONTAINER_NODE_STATE_DIR,
)
from sharing.limitsfile import BurstLimit, render_limits_file


def render_limits(
    plan: ClaimPlan,
    limits: Sequence[GpuLimit],
    context_sizes: Sequence[int | None] = (),
    memory: Sequence[ClaimMemory] = (),
) -> str:
    """limits: the plan's gpu_limits(); context_sizes: what a context takes on each GPU
    (driver/contextsize.py), None unknown; memory: the claim's checkpointed memory record in
    the same order (its burst limits and grant entries: docs/policy.md)."""
    bursts = [BurstLimit(m.limit, m.entry, m.key) if m.bursts else None for m in memory]
    any_burst = any(b is not None for b in bursts)
    return render_limits_file(
        bursts=bursts,
        burst_pool=CONTAINER_BURST_POOL if any_burst else None,
        show_limit=any_burst and plan.config.show_memory_limit,
        memory_limits=[g.memory_limit for g in limits],
        sm_limits=[g.sm_limit for g in limits],
        policy=plan.config.compute_policy,
        priority=plan.config.priority,
        shared_cache=CONTAINER_ACCOUNTING,
        node_state_dir=CONTAINER_NODE_STATE_DIR,
        demand_file=CONTAINER_DEMAND_FILE,
        context_sizes=context_sizes,
    )

"""The plugin's burst pool (docs/policy.md, "Memory that bursts and is given back").

A device's pool is what no prepared claim was allocated:

    pool = device memory - reservedMemory - sum of the requests of every claim in the checkpoint

(a claim counts from its PrepareStarted record until its entry is gone). The pool is divided into
grants, one per bursting (claim, device), in prepare order, oldest first:

    grant_k = min(limit_k - request_k, pool - sum of the grants of older claims)

so the grants never add up to more than the pool, and no slice can borrow a byte of another
claim's request. The grants are recomputed from the checkpoint (the one record of what is
prepared) whenever it changes, and written into the node-wide pool file (sharing/burstpool.py,
`struct vgpu_pool`) in two passes: every grant that falls (and every entry that is freed) first,
then, after the writes' fences, those that rise, so the sum stays within the pool at every
instant a slice can read it.

A claim's share of the pool is recorded in its checkpoint entry (ClaimEntry.memory: per GPU its
request, its limit and its grant entry with the entry's key); the plugin never reads a grant back
from the pool file, which is rewritten whole at start (recover()). An entry recorded by a plugin
that did not record memory (an older checkpoint) is counted as holding its whole GPU: no grant is
given from a pool the plugin cannot compute.

Not thread-safe: the caller (driver/state.py) holds its lock.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from driver.checkpoint import ClaimEntry, ClaimMemory
from sharing import burstpool
from sharing.gpus import GpuInfo
from sharing.policy import Rules

log = logging.getLogger(__name__)

RulesOf = Callable[[GpuInfo], Rules]
# a grant entry's fields: key, device, state, request, limit, grant, deadline (unix ns)
_Entry = tuple[int, int, int, int, int, int, int]


@dataclass(frozen=True)
class DeviceTotals:
    capacity: int
    reserved: int
    requested: int
    pool: int
    granted: int


@dataclass(frozen=True)
class Grants:
    """The grants of every bursting (claim uid, GPU index), and each device's totals."""

    grants: dict[tuple[str, int], int]
    devices: dict[int, DeviceTotals]


def compute(entries: Iterable[ClaimEntry], gpus: Sequence[GpuInfo], rules_of: RulesOf) -> Grants:
    """The grants the checkpoint's claims hold (docs/policy.md), oldest claim first."""
    by_index = {g.index: g for g in gpus}
    ordered = sorted(entries, key=lambda e: (e.seq, e.uid))
    requested = dict.fromkeys(by_index, 0)
    for e in ordered:
        if e.memory is None:  # an older plugin's record: its requests are not known
            for i, g in by_index.items():
                requested[i] += g.memory_total
            continue
        for m in e.memory:
            if m.gpu in requested:
                requested[m.gpu] += m.request
    devices: dict[int, DeviceTotals] = {}
    left: dict[int, int] = {}
    for i, g in by_index.items():
        reserved = rules_of(g).reserved_memory
        pool = max(0, g.memory_total - reserved - requested[i])
        left[i] = pool
        devices[i] = DeviceTotals(g.memory_total, reserved, requested[i], pool, 0)
    grants: dict[tuple[str, int], int] = {}
    for e in ordered:
        for m in e.memory or ():
            if not m.bursts:
                continue
            give = min(m.limit - m.request, left.get(m.gpu, 0))
            grants[(e.uid, m.gpu)] = give
            if m.gpu in left:
                left[m.gpu] -= give
    for i, d in devices.items():
        devices[i] = DeviceTotals(d.capacity, d.reserved, d.requested, d.pool, d.pool - left[i])
    return Grants(grants, devices)


def new_key() -> int:
    """A grant entry's key: random, never 0 (a free entry's)."""
    return secrets.randbits(62) + 1


def free_entries(entries: Iterable[ClaimEntry], n: int) -> list[int]:
    """n grant entries no claim of the checkpoint holds, lowest first; ValueError if full."""
    used = {m.entry for e in entries for m in (e.memory or ()) if m.bursts}
    out = [i for i in range(burstpool.MAX_GRANTS) if i not in used][:n]
    if len(out) < n:
        raise ValueError(
            f"the burst pool file's {burstpool.MAX_GRANTS} grant entries are all in use"
        )
    return out


class PoolFile:
    """The node-wide pool file, kept open read-write by the plugin."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pool: burstpool.Pool | None = None
        self._written: dict[int, _Entry] = {}

    def open(self) -> None:
        """Open the file, creating it (empty) when absent; a file that is not a pool file of this
        layout is replaced by an empty one. Every entry is rewritten by the next apply(full=True)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._pool = burstpool.Pool(self.path, writable=True)
            return
        except FileNotFoundError:
            pass
        except (burstpool.PoolFileError, OSError) as e:
            log.error("burst pool file %s: %s; replacing it with an empty one", self.path, e)
            os.unlink(self.path)
        burstpool.create(self.path, mode=0o644)
        self._pool = burstpool.Pool(self.path, writable=True)

    @property
    def is_open(self) -> bool:
        return self._pool is not None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def apply(
        self,
        entries: Sequence[ClaimEntry],
        grants: Grants,
        *,
        reclaims: dict[tuple[str, int], int] | None = None,
        full: bool = False,
    ) -> None:
        """Write the grants of the checkpoint's claims: falling grants and freed entries first,
        then rising ones. reclaims: (uid, gpu) -> deadline (unix ns) of an evict in progress
        (state RECLAIM; 0 under wait). full: rewrite every entry (at start)."""
        assert self._pool is not None, "open() first"
        reclaims = reclaims or {}
        want: dict[int, _Entry] = {}
        for e in entries:
            for m in e.memory or ():
                if not m.bursts:
                    continue
                deadline = reclaims.get((e.uid, m.gpu))
                state = burstpool.GRANT_OPEN if deadline is None else burstpool.GRANT_RECLAIM
                grant = grants.grants.get((e.uid, m.gpu), 0)
                want[m.entry] = (m.key, m.gpu, state, m.request, m.limit, grant, deadline or 0)
        free: _Entry = (0, 0, burstpool.GRANT_FREE, 0, 0, 0, 0)
        indices = range(burstpool.MAX_GRANTS) if full else set(self._written) | set(want)
        falling: list[tuple[int, _Entry]] = []
        rising: list[tuple[int, _Entry]] = []
        for i in sorted(indices):
            new = want.get(i, free)
            old = self._written.get(i)
            if not full and old == new:
                continue
            # first pass: an entry freed, or whose grant falls or stays (its state may change);
            # second: a new owner's grant above 0, and every grant that rises
            lower = new[5] == 0 or (old is not None and old[0] == new[0] and new[5] <= old[5])
            (falling if lower else rising).append((i, new))
        for i, new in falling + rising:
            key, device, state, request, limit, grant, deadline = new
            self._pool.write_grant(i, key=key, device=device, state=state, request=request,
                                   limit=limit, grant=grant, deadline_unix_ns=deadline)  # fmt: skip
            if new == free:
                self._written.pop(i, None)
            else:
                self._written[i] = new
        for index, d in grants.devices.items():
            if 0 <= index < burstpool.MAX_DEVICES:
                self._pool.write_device(index, capacity=d.capacity, reserved=d.reserved,
                                        requested=d.requested, pool=d.pool,
                                        granted=d.granted)  # fmt: skip


def plan_memory(
    gpu_limits: Sequence[tuple[int, int, int]], entries: Iterable[ClaimEntry]
) -> tuple[ClaimMemory, ...]:
    """A new claim's memory record: per (GPU index, request, burst limit or 0) in container order,
    with a free grant entry and a new key for each bursting one."""
    bursting = [g for g in gpu_limits if g[2] > g[1]]
    slots = iter(free_entries(entries, len(bursting)))
    out = []
    for gpu, request, limit in gpu_limits:
        if limit > request:
            out.append(ClaimMemory(gpu=gpu, request=request, limit=limit, entry=next(slots),
                                   key=new_key()))  # fmt: skip
        else:
            out.append(ClaimMemory(gpu=gpu, request=request))
    return tuple(out)

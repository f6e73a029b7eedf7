"""The orphan sweep at the plugin's start: files of ours that no checkpoint entry owns (defence
in depth), and temporary files of writes a crash cut short. One failure is logged; the sweep
goes on."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from pathlib import Path

from cdi.spec import transient_spec_uid
from cdi.writer import is_write_leftover
from driver import hostfs
from driver.claimfiles import HostPaths
from driver.trash import Trash
from sharing.claimlayout import DEMAND_SUFFIX

log = logging.getLogger(__name__)


def remove_orphans(
    known: Collection[str],
    *,
    kind: str,
    cdi_root: Path,
    checkpoint_path: Path,
    paths: HostPaths,
    trash: Trash,
) -> None:
    """Remove what belongs to no UID in `known` (call with the plugin's lock held: claim
    directories go to `trash`, whose moved names the caller hands to its remover)."""

    def spec_orphan(name: str) -> bool:
        uid = transient_spec_uid(kind, name)
        return (uid is not None and uid not in known) or is_write_leftover(kind, name)

    sweeps: list[tuple[Path, Callable[[str], bool]]] = [
        (cdi_root, spec_orphan),
        (paths.claims_dir, lambda n: n not in known),
        (paths.node_state_dir, lambda n: n.endswith(DEMAND_SUFFIX)
                                         and n[: -len(DEMAND_SUFFIX)] not in known),
        (checkpoint_path.parent, lambda n: n.startswith(f".{checkpoint_path.name}.")
                                           and n.endswith(".tmp")),
    ]  # fmt: skip
    for root, orphan in sweeps:
        try:
            names = sorted(os.listdir(root))
        except FileNotFoundError:
            continue
        except OSError as e:
            log.error("cannot list %s for orphans: %s", root, e)
            continue
        for name in filter(orphan, names):
            try:
                if root == paths.claims_dir:
                    removed = trash.move(root / name)
                else:
                    removed = hostfs.remove(root / name, root)
                if removed:
                    log.warning("removed orphan %s", root / name)
            except Exception as e:
                log.error("cannot remove orphan %s: %s; continuing", root / name, e)

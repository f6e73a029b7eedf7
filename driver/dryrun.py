"""`vgpu-kubelet-plugin --dry-run`: this node's ResourceSlices on stdout, without an API server.

The GPUs come from NVML (the simulator's libnvidia-ml.so.1 included), through the same
discovery and slice building the running plugin publishes with, so an admin can feed
`vgpu plan` with nodes not yet in the cluster. The output is a `kind: List` as
`kubectl get resourceslices -o yaml` prints it (pool generation 1, no owner references).
`--sharing-mode auto` cannot ask an API server here and prints sharing mode (consumable
capacity, Kubernetes 1.36+ or the DRAConsumableCapacity gate); pass partition for older ones.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

import yaml

from driver.devicenames import PARTITION, SHARING, Mode
from driver.discovery import Discovery, NvmlBackend
from driver.flags import Settings
from driver.publishloop import describe_error
from driver.slicebuild import RulesFor, pool_slices, too_small_messages

log = logging.getLogger(__name__)


def dry_run(
    settings: Settings,
    backend: NvmlBackend,
    *,
    rules_for: RulesFor | None = None,
    sysfs_root: Path = Path("/sys"),
    out: TextIO = sys.stdout,
    nvml_hint: str = "is the NVIDIA driver loaded and /dev/nvidia* visible?",
) -> int:
    """Print the slices (as the admin policy `rules_for` shapes them; default: the built-in
    policy); 0 on success, 1 when NVML cannot list the GPUs."""
    try:
        gpus = backend.list_gpus()
    except Exception as e:
        log.error("NVML: cannot list GPUs (%s); %s", describe_error(e), nvml_hint)
        return 1
    mode: Mode = PARTITION if settings.sharing_mode == PARTITION else SHARING
    if settings.sharing_mode == "auto":
        log.info("--dry-run: no API server to ask; printing sharing-mode slices")
    inv = Discovery(backend, sysfs_root=sysfs_root).inventory(gpus, {})
    for message in too_small_messages(
        inv, mode, settings.node_name, settings.partitions, rules_for
    ):
        log.warning("%s", message)
    slices = pool_slices(
        inv,
        mode,
        settings.partitions,
        settings.driver_name,
        settings.node_name,
        generation=1,
        rules_for=rules_for,
    )
    doc = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}, "items": slices}
    out.write(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False))
    return 0

"""The claim contract: which files a prepared claim has, their names and where they appear.

The DRA plugin creates them (driver/claimfiles.py, driver/claimspec.py, driver/driver.py), the observers find them
(sharing/observe/slices.py), and the shim reads the limits file at CONTAINER_LIMITS (shim/src/settings.h's
VGPU_LIMITS_CONTAINER_PATH; tests/sharing/test_claimlayout.py ties the two).

On the node, under the plugin's data directory (`--data-dir`, DEFAULT_DATA_DIR):

    checkpoint.json                  prepared claims (driver/checkpoint.py)
    publish-mode                     the publishing mode `--sharing-mode auto` last decided
    lib/libvgpu.so, lib/ld.so.preload  the shim and the preload list the CDI specs mount
    claims/<uid>/                    0755 root, never mounted writable
    claims/<uid>/limits              0444: the claim's limits (sharing/limitsfile.py)
    claims/<uid>/shared/             0755 root, never mounted
    claims/<uid>/shared/accounting   0666: the slice's accounting file (usage only), mounted
                                     alone, read-write, at CONTAINER_ACCOUNTING
    claims/<uid>/metadata/<request>.json  0444: the device metadata of one request (KEP-5304),
                                     mounted read-only under CONTAINER_METADATA_ROOT
    trash/                           0700: claim directories moved aside before removal
    node-state/<uid>.demand          0666: the claim's elastic-demand record
    burst-pool                       0644: the node's burst pool file (sharing/burstpool.py),
                                     mounted read-only into bursting claims at CONTAINER_BURST_POOL

In the container: the shim and its limits under CONTAINER_LIB_DIR, read-only; the claim's
accounting file at CONTAINER_ACCOUNTING; the node's demand records read-only at
CONTAINER_NODE_STATE_DIR and the claim's own one writable at CONTAINER_DEMAND_FILE.

Outside Kubernetes, `vgpu run --region FILE` keeps that slice's limits in FILE +
REGION_LIMITS_SUFFIX for the observers.
"""

from __future__ import annotations

# The host side, relative to the data directory.
DEFAULT_DATA_DIR = "/var/lib/vgpu-sharing"
# The plugin's default --driver-name: its claims' driver, and the label the observers give them.
DEFAULT_DRIVER_NAME = "vgpu.sharing.dev"
CHECKPOINT_FILE = "checkpoint.json"
MODE_FILE = "publish-mode"
LIB_DIR = "lib"
SHIM_LIBRARY = "libvgpu.so"
PRELOAD_FILE = "ld.so.preload"
CLAIMS_DIR = "claims"
NODE_STATE_DIR = "node-state"
BURST_POOL_FILE = "burst-pool"  # the node's burst pool (docs/policy.md, issue 37)
TRASH_DIR = "trash"  # claim directories moved aside, removed outside the plugin's lock
# Inside one claim's directory.
LIMITS_FILE = "limits"
SHARED_DIR = "shared"
ACCOUNTING_FILE = "accounting"  # inside SHARED_DIR
DEMAND_SUFFIX = ".demand"  # NODE_STATE_DIR/<uid>.demand
METADATA_DIR = "metadata"  # one <request>.json per top-level request of the claim

# The container side.
CONTAINER_LIB_DIR = "/usr/local/lib/vgpu-sharing"
CONTAINER_LIB = f"{CONTAINER_LIB_DIR}/{SHIM_LIBRARY}"
CONTAINER_LIMITS = f"{CONTAINER_LIB_DIR}/{LIMITS_FILE}"
CONTAINER_PRELOAD = "/etc/ld.so.preload"
CONTAINER_CLAIM_DIR = "/run/vgpu-sharing"
CONTAINER_ACCOUNTING = f"{CONTAINER_CLAIM_DIR}/{ACCOUNTING_FILE}"
CONTAINER_NODE_STATE_DIR = "/run/vgpu-node"
CONTAINER_DEMAND_FILE = "/run/vgpu-demand"
CONTAINER_BURST_POOL = "/run/vgpu-burst-pool"  # a bursting claim's read-only mount of the pool
# Kubernetes' device metadata (KEP-5304): <root>/resourceclaims/<claim>/<request>/<driver>-metadata.json,
# or resourceclaimtemplates/<pod claim name>/... for a claim made from a template.
CONTAINER_METADATA_ROOT = "/var/run/kubernetes.io/dra-device-attributes"

# `vgpu run --region FILE`: FILE.limits.
REGION_LIMITS_SUFFIX = ".limits"


def claim_limits(claims_dir: str, uid: str) -> str:
    return f"{claims_dir}/{uid}/{LIMITS_FILE}"


def claim_accounting(claims_dir: str, uid: str) -> str:
    return f"{claims_dir}/{uid}/{SHARED_DIR}/{ACCOUNTING_FILE}"


def demand_name(uid: str) -> str:
    return f"{uid}{DEMAND_SUFFIX}"

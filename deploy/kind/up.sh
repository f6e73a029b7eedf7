#!/usr/bin/env bash
# Try vgpu-sharing on a laptop: a kind cluster with simulated GPUs (no GPU needed).
#   1. creates the kind cluster $CLUSTER (deploy/kind/cluster.yaml: DRA consumable capacity on,
#      CDI enabled in containerd) unless it exists;
#   2. builds the image (scripts/build-image) and loads it into the cluster's node;
#   3. applies deploy/overlays/sim (every node publishes SIM_GPUS simulated H100s) and waits
#      for the plugin and its ResourceSlices;
#   4. applies the examples of the mode the plugin chose (sharing, or partition where the
#      cluster drops consumable capacity) and prints what each pod saw: its share of the GPU,
#      and the allocation refused past its quota.
# Needs: kind, kubectl, podman or docker; Kubernetes 1.34+ node image (KIND_NODE_IMAGE, e.g.
# kindest/node:v1.34.0; default: kind's own). Remove it all: kind delete cluster --name vgpu-sim
# Environment: CLUSTER (vgpu-sim), KIND_NODE_IMAGE, IMAGE (localhost/vgpu-sharing:0.1.0),
# SKIP_BUILD=1 (load an image built earlier), and scripts/build-image's (BASE, WHEELS, ...).
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${CLUSTER:-vgpu-sim}
IMAGE=${IMAGE:-localhost/vgpu-sharing:0.1.0}
ENGINE=${ENGINE:-$(command -v podman >/dev/null 2>&1 && echo podman || echo docker)}
KUBECTL=${KUBECTL:-$(command -v kubectl || echo .venv/bin/kubectl)}

log() { printf '[kind-up] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

command -v kind >/dev/null 2>&1 || die "kind is not installed (https://kind.sigs.k8s.io)"
[ -x "$KUBECTL" ] || command -v "$KUBECTL" >/dev/null 2>&1 || die "kubectl is not installed"
[ "$ENGINE" = podman ] && export KIND_EXPERIMENTAL_PROVIDER=${KIND_EXPERIMENTAL_PROVIDER:-podman}
kc() { "$KUBECTL" --context "kind-$CLUSTER" "$@"; }

if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    log "cluster $CLUSTER exists; reusing it"
else
    log "creating kind cluster $CLUSTER"
    kind create cluster --name "$CLUSTER" --config deploy/kind/cluster.yaml \
        ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
fi

if [ "${SKIP_BUILD:-}" != 1 ]; then
    IMAGE="$IMAGE" ENGINE="$ENGINE" scripts/build-image
fi
log "loading $IMAGE into the cluster's node"
if [ "$ENGINE" = podman ]; then
    archive=$(mktemp --suffix=.tar)
    trap 'rm -f "$archive"' EXIT
    podman save --format docker-archive -o "$archive" "$IMAGE"
    kind load image-archive "$archive" --name "$CLUSTER"
else
    kind load docker-image "$IMAGE" --name "$CLUSTER"
fi

log "applying deploy/overlays/sim"
kc apply -k deploy/overlays/sim
kc -n vgpu-sharing rollout status ds/vgpu-kubelet-plugin --timeout=180s
for _ in $(seq 60); do
    [ -n "$(kc get resourceslices -o name 2>/dev/null)" ] && break
    sleep 2
done
kc get resourceslices -o wide
if kc get resourceslices -o jsonpath='{.items[*].spec.devices[*].allowMultipleAllocations}' |
    grep -q true; then
    mode=sharing
    examples=(share-4gi-25pct two-containers-one-claim refused-past-quota)
else
    mode=partition
    examples=(one-slice two-containers-one-claim refused-past-quota)
fi
log "the plugin publishes in $mode mode; applying deploy/examples/$mode: ${examples[*]}"
pods=()
for e in "${examples[@]}"; do
    while read -r obj; do
        case $obj in pod/*) pods+=("${obj#pod/}") ;; esac
    done < <(kc apply -f "deploy/examples/$mode/$e.yaml" -o name)
done
for pod in "${pods[@]}"; do
    if ! kc wait --for=jsonpath='{.status.phase}'=Succeeded "pod/$pod" --timeout=300s >/dev/null; then
        log "pod $pod did not succeed:"
        kc describe pod "$pod" | tail -20 >&2
    fi
    echo "=== $pod"
    kc logs "$pod" --all-containers --prefix
done
log "done. The examples stay for a look (kubectl get pods,resourceclaims); remove them with"
log "kubectl delete -f deploy/examples/$mode/<name>.yaml, the cluster with: kind delete cluster --name $CLUSTER"

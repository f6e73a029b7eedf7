#!/usr/bin/env bash
# Build the multi-call k8s binary (etcd + control plane + kubelet + kubectl) for one
# Kubernetes version from the Go module proxy.
# usage: cluster/build-k8s.sh VERSION OUTDIR      (GOMODCACHE/GOCACHE from the environment)
# The staging-module replace list is generated from the downloaded k8s.io/kubernetes go.mod.
set -euo pipefail
V=${1:?version, e.g. 1.37.2}
OUT=${2:?output dir}
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$OUT/src
mkdir -p "$SRC" "$OUT/bin"

go mod download -json "k8s.io/kubernetes@v$V" >/dev/null
MOD=$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/v$V.mod
GOLINE=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$MOD")
ETCD=$(sed -n 's|^\s*go.etcd.io/etcd/server/v3 \(v[^ ]*\).*|\1|p' "$MOD")
mapfile -t STAGING < <(sed -n 's|^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*|\1|p' "$MOD")
[ "${#STAGING[@]}" -gt 20 ] || { echo "build-k8s: found only ${#STAGING[@]} staging modules in $MOD" >&2; exit 1; }

{
	echo "module local/k8sbins"
	echo
	echo "go $GOLINE"
	echo
	echo "godebug default=go${GOLINE%.*}"
	echo
	echo "require ("
	echo "	k8s.io/kubernetes v$V"
	echo "	go.etcd.io/etcd/server/v3 $ETCD"
	echo ")"
	echo
	echo "replace ("
	for m in "${STAGING[@]}"; do echo "	$m => $m v0.${V#1.}"; done
	echo ")"
} >"$SRC/go.mod.new"
# go mod tidy only when the generated go.mod or main.go changed (the stamp holds both).
cat "$SRC/go.mod.new" "$HERE/k8s/main.go" >"$SRC/stamp.new"
if ! cmp -s "$SRC/stamp.new" "$SRC/stamp"; then
	cp "$HERE/k8s/main.go" "$SRC/main.go"
	cp "$SRC/go.mod.new" "$SRC/go.mod"
	rm -f "$SRC/go.sum"
	(cd "$SRC" && go mod tidy)
	mv "$SRC/stamp.new" "$SRC/stamp"
fi
rm -f "$SRC/go.mod.new" "$SRC/stamp.new"

MINOR=${V#1.}; MINOR=${MINOR%%.*}
PKG=k8s.io/component-base/version
CPKG=k8s.io/client-go/pkg/version
LD="-s -w"
for p in $PKG $CPKG; do
	LD+=" -X $p.gitVersion=v$V -X $p.gitMajor=1 -X $p.gitMinor=$MINOR -X $p.gitTreeState=clean"
	LD+=" -X $p.buildDate=1970-01-01T00:00:00Z"
done
(cd "$SRC" && CGO_ENABLED=0 go build -trimpath -ldflags "$LD" -o "$OUT/bin/k8s.new" .)
mv "$OUT/bin/k8s.new" "$OUT/bin/k8s"
for n in etcd kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet kubectl; do
	ln -sfn k8s "$OUT/bin/$n"
done

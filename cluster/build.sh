#!/usr/bin/env bash
# Builds the local control plane from its Go modules (versions.env), once: the binaries land in a
# cache folder keyed by the pins, which later runs (and CI on the same machine) reuse.
#   cluster/build.sh OUT_BIN_DIR
# k8s.io/kubernetes is built as a dependency: its go.mod replaces every staging module with
# ./staging/src/..., which a dependency's replace lines cannot do, so ours point each one at the
# published staging module of the same minor (v1.X.Y -> v0.X.Y), the usual way.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUT_BIN_DIR}
# shellcheck source=/dev/null
source "$here/versions.env"
key=$(cat "$here/versions.env" "$here/build.sh" | sha256sum | cut -c1-16)
cache=${KILN_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/cluster}/$key
export GOFLAGS="-mod=mod -trimpath" GOSUMDB=${GOSUMDB:-off} CGO_ENABLED=0
bins="etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm lws-controller"

have_all() { for b in $bins; do [ -x "$cache/bin/$b" ] || return 1; done; [ -d "$cache/crds" ]; }

module() {  # module DIR NAME: an empty module to build upstream main packages in
  rm -rf "$1" && mkdir -p "$1" && (cd "$1" && go mod init "kiln.local/$2" >/dev/null 2>&1)
}

build_etcd() {
  local m=$cache/src/etcd; module "$m" etcd
  (cd "$m" && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null &&
    go build -ldflags "-s -w" -o "$cache/bin/etcd" go.etcd.io/etcd/server/v3)
}

build_kubernetes() {
  local m=$cache/src/kubernetes staging=v0.${KUBERNETES_VERSION#v1.}
  module "$m" kubernetes
  local kmod; kmod=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" |
    sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\1#p' "$kmod" | while read -r s; do
    echo "replace $s => $s $staging" >> "$m/go.mod"; done
  local minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
  local v=k8s.io/component-base/version
  local ld="-s -w -X $v.gitVersion=$KUBERNETES_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor"
  ld="$ld -X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z"
  (cd "$m" && go get "k8s.io/kubernetes@$KUBERNETES_VERSION" >/dev/null &&
    go build -ldflags "$ld" -o "$cache/bin/" k8s.io/kubernetes/cmd/kube-apiserver \
      k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
      k8s.io/kubernetes/cmd/kubectl)
}

build_helm() {
  local m=$cache/src/helm; module "$m" helm
  local v=helm.sh/helm/v3/internal/version
  (cd "$m" && go get "helm.sh/helm/v3@$HELM_VERSION" >/dev/null &&
    go build -ldflags "-s -w -X $v.version=$HELM_VERSION" -o "$cache/bin/helm" helm.sh/helm/v3/cmd/helm)
}

build_lws() {
  local m=$cache/src/lws; module "$m" lws
  (cd "$m" && go get "sigs.k8s.io/lws@$LWS_VERSION" >/dev/null &&
    go build -ldflags "-s -w" -o "$cache/bin/lws-controller" sigs.k8s.io/lws/cmd)
}

fetch_crds() {  # the CRDs kiln's rendered objects are applied against, from the same module proxy
  mkdir -p "$cache/crds.tmp"
  local d
  d=$(go mod download -json "sigs.k8s.io/lws@$LWS_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  cp "$d"/config/crd/bases/*.yaml "$cache/crds.tmp/"
  d=$(go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  cp "$d"/config/crd/bases/keda.sh_scaledobjects.yaml "$cache/crds.tmp/"
  d=$(go mod download -json "sigs.k8s.io/gateway-api-inference-extension@$GIE_VERSION" |
    sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  cp "$d"/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml "$cache/crds.tmp/"
  chmod u+w "$cache"/crds.tmp/* && rm -rf "$cache/crds" && mv "$cache/crds.tmp" "$cache/crds"
}

if ! have_all; then
  mkdir -p "$cache/bin"
  start=$SECONDS
  [ -x "$cache/bin/etcd" ] || build_etcd
  [ -x "$cache/bin/kubectl" ] || build_kubernetes
  [ -x "$cache/bin/helm" ] || build_helm
  [ -x "$cache/bin/lws-controller" ] || build_lws
  [ -d "$cache/crds" ] || fetch_crds
  echo "cluster: built the control plane in $((SECONDS - start)) s into $cache" >&2
fi
mkdir -p "$out"
for b in $bins; do ln -sfn "$cache/bin/$b" "$out/$b"; done
ln -sfn "$cache/crds" "$out/../third-party-crds"

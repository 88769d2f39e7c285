#!/usr/bin/env bash
# Build the Go tools the tests need (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
# etcd, containerd, helm, promtool, kueue, SeaweedFS's weed) from the wrapper modules beside this
# script into a cache outside the repository, keyed by the wrapper's files: a second run with
# nothing changed does nothing. A wrapper's programs are built by one `go build`, so what they
# share is compiled once.
# A folder with a requirements.txt instead (checkov) is a Python tool, installed into a virtualenv
# of its own. A wrapper's debian-packages file names what it needs from Debian (containerd: runc,
# the CNI plugins, busybox-static for the node's images); they are installed when missing (root).
#   tools/build.sh NAME...   NAME: kube | etcd | containerd | helm | promtool | kueue | seaweedfs | checkov | <any folder here>
# The cache is $K8S_DISPATCH_TOOLS (default ~/.cache/k8s-dispatch/tools); prints where each
# tool's binaries are.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${K8S_DISPATCH_TOOLS:-$HOME/.cache/k8s-dispatch/tools}
export GOFLAGS=${GOFLAGS:--mod=mod} GOTOOLCHAIN=${GOTOOLCHAIN:-local}

log() { echo "tools: $*" >&2; }

# Which programs each wrapper builds, and the ldflags that set their version strings.
programs() {
    case $1 in
        kube) echo "k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet" ;;
        containerd) echo "github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 github.com/containerd/containerd/v2/cmd/ctr ./pause" ;;
        promtool) echo "github.com/prometheus/prometheus/cmd/promtool" ;;
        helm) echo "helm.sh/helm/v3/cmd/helm" ;;
        kueue) echo "sigs.k8s.io/kueue/cmd/kueue" ;;
        seaweedfs) echo "github.com/seaweedfs/seaweedfs/weed" ;;
        *) echo "." ;;
    esac
}

# Build tags: containerd's snapshotters for btrfs, devmapper and ZFS need C headers and are not used.
tags() {
    case $1 in
        containerd) echo "no_btrfs no_devmapper no_zfs" ;;
        *) ;;
    esac
}

module_version() { # the version the wrapper pins of module $2
    (cd "$here/$1" && go list -m -f '{{.Version}}' "$2")
}

ldflags() {
    case $1 in
        kube)
            local v; v=$(module_version kube k8s.io/kubernetes)
            local major=${v#v}; major=${major%%.*}
            local minor=${v#v*.}; minor=${minor%%.*}
            local p
            for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
                printf -- '-X %s.gitVersion=%s -X %s.gitMajor=%s -X %s.gitMinor=%s -X %s.gitTreeState=clean -X %s.buildDate=1970-01-01T00:00:00Z ' \
                    "$p" "$v" "$p" "$major" "$p" "$minor" "$p" "$p"
            done ;;
        promtool) # module v0.316.0 is Prometheus 3.16.0
            local v; v=$(module_version promtool github.com/prometheus/prometheus)
            local minor=${v#v0.}; minor=${minor%%.*}; local patch=${v##*.}
            printf -- '-X github.com/prometheus/common/version.Version=3.%s.%s -X github.com/prometheus/common/version.Revision=%s' \
                "$((minor - 300))" "$patch" "$v" ;;
        helm) printf -- '-X helm.sh/helm/v3/internal/version.version=%s -X helm.sh/helm/v3/internal/version.gitTreeState=clean' \
            "$(module_version helm helm.sh/helm/v3)" ;;
        kueue) printf -- '-X sigs.k8s.io/kueue/pkg/version.GitVersion=%s' "$(module_version kueue sigs.k8s.io/kueue)" ;;
        seaweedfs) # `weed version` names the pseudo-version the wrapper pins (the release number is in the code)
            printf -- '-X github.com/seaweedfs/seaweedfs/weed/util/version.COMMIT=%s' "$(module_version seaweedfs github.com/seaweedfs/seaweedfs)" ;;
        containerd) # the CRI reports this version to the kubelet, which requires 2.0 or newer
            local v; v=$(module_version containerd github.com/containerd/containerd/v2)
            printf -- '-X github.com/containerd/containerd/v2/version.Version=%s -X github.com/containerd/containerd/v2/version.Revision=%s' "$v" "$v" ;;
        *) ;;
    esac
}

# A Python tool (a requirements.txt instead of a go.mod): a virtualenv of its own in the cache,
# so its pins never meet the project's; its programs are in <dir>/bin.
build_python() {
    local name=$1 dir=$here/$1
    local key; key=$( { cat "$dir/requirements.txt"; "${PYTHON:-python3}" --version; } | sha256sum | cut -c1-16)
    local out=$cache/$name-$key
    if [ -f "$out/.complete" ]; then echo "$out"; return; fi
    rm -rf "$out"; mkdir -p "$cache"
    local start=$SECONDS
    log "installing $name into $out"
    "${PYTHON:-python3}" -m venv "$out"
    "$out/bin/pip" install -q --disable-pip-version-check --require-hashes -r "$dir/requirements.txt" >&2
    touch "$out/.complete"
    log "$name installed in $((SECONDS - start)) s"
    echo "$out"
}

# Installs the Debian packages named in $1 (one a line, # comments) that are not installed yet.
install_debian() {
    local wanted; wanted=$(sed -e 's/#.*//' "$1" | xargs)
    [ -n "$wanted" ] || return 0
    local missing=() p
    for p in $wanted; do dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing Debian packages: ${missing[*]}"
    local sudo=(); [ "$(id -u)" = 0 ] || sudo=(sudo -n)
    "${sudo[@]}" apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >&2
}

build_one() {
    local name=$1 dir=$here/$1
    if [ -f "$dir/requirements.txt" ]; then build_python "$name"; return; fi
    [ -f "$dir/go.mod" ] || { log "no wrapper module $dir"; exit 2; }
    if [ -f "$dir/debian-packages" ]; then install_debian "$dir/debian-packages"; fi
    # Keyed by what goes into the build: the wrapper's files, the packages, the flags and Go's
    # version (not this whole script: adding a tool here must not rebuild the others).
    local flags; flags=$(ldflags "$name")
    local buildtags; buildtags=$(tags "$name")
    local key; key=$( {
        cat "$dir"/go.mod "$dir"/go.sum "$dir"/*.go 2>/dev/null; cat "$dir"/*/*.go 2>/dev/null || true
        programs "$name"; echo "$flags"; [ -z "$buildtags" ] || echo "tags $buildtags"; go env GOVERSION
    } | sha256sum | cut -c1-16)
    local out=$cache/$name-$key
    if [ -f "$out/.complete" ]; then echo "$out"; return; fi
    mkdir -p "$out"
    local start=$SECONDS
    log "building $name into $out (cold on 2 cores: several minutes; go's build cache makes the next one quick)"
    local pkgs; pkgs=$(programs "$name")
    log "  go build $pkgs"
    if [ "$pkgs" = . ]; then
        (cd "$dir" && CGO_ENABLED=0 go build -trimpath -tags "$buildtags" -ldflags "-s -w $flags" -o "$out/$name" .)
    else
        # shellcheck disable=SC2086 # one word per package
        (cd "$dir" && CGO_ENABLED=0 go build -trimpath -tags "$buildtags" -ldflags "-s -w $flags" -o "$out/" $pkgs)
    fi
    touch "$out/.complete"
    log "$name built in $((SECONDS - start)) s"
    echo "$out"
}

# One build of a tool at a time: a second caller (another test process, `make tools` beside a
# test) waits for the first and finds its result, instead of compiling the same tool again.
build_locked() {
    mkdir -p "$cache"
    ( flock 9; build_one "$1" ) 9>"$cache/.$1.lock"
}

[ $# -gt 0 ] || { echo "usage: $0 NAME..." >&2; exit 2; }
for name in "$@"; do build_locked "$name"; done

#!/usr/bin/env bash
# `make images`: build the gateway, draft and verify images on this machine (CPU variants) and print
# their sizes. The tags are the ones deploy/k8s/overlays/dev references ($REGISTRY/specd-<role>:$TAG).
#
# On a machine without a container registry (the project's build machines) it also
#   - installs Debian's docker.io and starts dockerd by hand when no engine answers (no systemd);
#   - makes the base image once: debootstrap of Debian bookworm (minbase + python3, venv, CA
#     certificates) from the mirror apt uses, imported as $BASE. With a registry, skip that and pass
#     the public bases: BASE=python:3.11-slim-bookworm (or any image with python3 and venv);
#   - puts build extras in .image-build/ for the length of the build (deploy/docker/pip-env.sh): the
#     machine's extra CA certificates (they change at every boot: copied now, never kept in an image)
#     and the local CPU torch wheel (else pip pulls the CUDA build, several GB).
# Environment: REGISTRY (localhost:5000), TAG (dev), BASE (specd-local/debian-python:bookworm),
# ROLES ("gateway draft verify").
set -euo pipefail
cd "$(dirname "$0")/../.."

REGISTRY=${REGISTRY:-localhost:5000}
TAG=${TAG:-dev}
BASE=${BASE:-specd-local/debian-python:bookworm}
ROLES=${ROLES:-gateway draft verify}
TORCH_VERSION=2.13.0
EXTRA=.image-build

say() { printf '%s images: %s\n' "$(date +%T)" "$*" >&2; }

ensure_engine() {
    docker info >/dev/null 2>&1 && return
    if ! command -v dockerd >/dev/null; then
        say "installing Debian's docker.io"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null
    fi
    say "starting dockerd (log: /tmp/specd-dockerd.log)"
    nohup dockerd >/tmp/specd-dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
    say "dockerd did not start; see /tmp/specd-dockerd.log"; exit 1
}

apt_mirror() {
    # The first Debian URI apt is configured with (deb822 or one-line sources).
    { grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' || true
      grep -h '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' || true; } | { grep -v security || true; } | head -1
}

ensure_base() {
    docker image inspect "$BASE" >/dev/null 2>&1 && return
    [[ "$BASE" == specd-local/* ]] || { docker pull "$BASE"; return; }
    command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
    local root mirror
    root=$(mktemp -d /tmp/specd-rootfs.XXXXXX)
    mirror=$(apt_mirror)
    say "making $BASE with debootstrap from ${mirror:-http://deb.debian.org/debian}"
    debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
        bookworm "$root" "${mirror:-http://deb.debian.org/debian}" >/tmp/specd-debootstrap.log
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$BASE" >/dev/null
    rm -rf "$root"
}

stage_extras() {
    rm -rf "$EXTRA" && mkdir -p "$EXTRA/ca" "$EXTRA/wheels"
    cp /usr/local/share/ca-certificates/*.crt "$EXTRA/ca/" 2>/dev/null || rmdir "$EXTRA/ca"
    local wheel
    wheel=$(ls /opt/wheels/torch-"$TORCH_VERSION"+cpu-*.whl 2>/dev/null | head -1 || true)
    if [[ -z "$wheel" ]]; then  # elsewhere: pip download torch==$TORCH_VERSION --index-url https://download.pytorch.org/whl/cpu
        say "no CPU torch wheel in /opt/wheels; put torch-$TORCH_VERSION+cpu-*.whl there"; exit 1
    fi
    cp "$wheel" "$EXTRA/wheels/"
}

build() {
    local role=$1 started args=()
    case $role in
        gateway) args=(--build-arg "PYTHON_IMAGE=$BASE") ;;
        *) args=(--build-arg "BASE_IMAGE=$BASE" --build-arg DEVICE=cpu --build-arg "TORCH_VERSION=$TORCH_VERSION") ;;
    esac
    started=$(date +%s)
    say "building $REGISTRY/specd-$role:$TAG"
    docker build --network host -q -f "deploy/docker/$role.Dockerfile" "${args[@]}" -t "$REGISTRY/specd-$role:$TAG" . >/dev/null
    say "built $REGISTRY/specd-$role:$TAG in $(( $(date +%s) - started )) s"
}

ensure_engine
ensure_base
trap 'rm -rf "$EXTRA"' EXIT
stage_extras
for role in $ROLES; do build "$role"; done
# The gateway image must stay torch-free: checked on the built image, not only in its Dockerfile.
if [[ " $ROLES " == *" gateway "* ]]; then
    docker run --rm --entrypoint python "$REGISTRY/specd-gateway:$TAG" -c \
        "import importlib.util as u, sys; sys.exit(1 if u.find_spec('torch') or u.find_spec('transformers') else 0)" \
        || { say "the gateway image contains torch or transformers"; exit 1; }
fi
docker image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' | grep -E "specd-(gateway|draft|verify):$TAG" | sort

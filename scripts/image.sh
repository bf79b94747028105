#!/usr/bin/env bash
# Build the userdp image from deploy/Dockerfile without a container registry: only Debian's
# package servers and PyPI are needed (and a local torch wheel).
#
#   scripts/image.sh base    debootstrap Debian bookworm (Python 3.11) and import it as $BASE
#   scripts/image.sh build   build deploy/Dockerfile on $BASE: CPU variant, the base's Python,
#                            torch from the wheel folder $TORCH_WHEELS
#   scripts/image.sh check   run `userdp --version` in a container of $IMAGE
#   scripts/image.sh all     all three (the default)
#
# The slow test tests/deploy/test_image.py runs a coordinator and two workers from $IMAGE.
#
# Environment (defaults in brackets):
#   ENGINE         podman or docker [podman if installed, else docker]
#   BASE           base image name [localhost/userdp-base:bookworm]
#   IMAGE          image name [localhost/userdp:cpu]
#   TORCH_WHEELS   folder holding torch-<version>+cpu-*.whl [/opt/wheels]
#   DEBIAN_MIRROR  [http://deb.debian.org/debian]
#   WORK           scratch folder for the root filesystem [/var/tmp/userdp-image]
#   EXTRA_CA       a PEM bundle the image trusts besides Debian's CAs, e.g. the CA of a
#                  TLS-inspecting proxy between the build and PyPI [none]
#   BUILD_OPTS     extra options for the build, e.g. "--isolation chroot" where the engine's
#                  OCI runtime cannot start containers [none]
# Needs root for debootstrap (apt-get install debootstrap podman).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENGINE="${ENGINE:-$(command -v podman >/dev/null && echo podman || echo docker)}"
BASE="${BASE:-localhost/userdp-base:bookworm}"
IMAGE="${IMAGE:-localhost/userdp:cpu}"
TORCH_WHEELS="${TORCH_WHEELS:-/opt/wheels}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
WORK="${WORK:-/var/tmp/userdp-image}"

fail() { echo "scripts/image.sh: $*" >&2; exit 2; }

base() {
    command -v debootstrap >/dev/null || fail "debootstrap not found (apt-get install debootstrap)"
    local rootfs="$WORK/rootfs"
    if [ ! -x "$rootfs/usr/bin/python3" ]; then
        rm -rf "$rootfs"
        mkdir -p "$WORK"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$rootfs" "$DEBIAN_MIRROR"
    fi
    if [ -n "${EXTRA_CA:-}" ]; then
        mkdir -p "$rootfs/usr/local/share/ca-certificates"
        cp "$EXTRA_CA" "$rootfs/usr/local/share/ca-certificates/userdp-extra-ca.crt"
        chroot "$rootfs" update-ca-certificates
    fi
    tar -C "$rootfs" -c . | "$ENGINE" import --change 'CMD ["/bin/bash"]' - "$BASE"
}

build() {
    local wheel version
    wheel="$(ls "$TORCH_WHEELS"/torch-*+cpu-cp311-*.whl 2>/dev/null | head -n1)" \
        || fail "no torch-*+cpu-cp311 wheel in TORCH_WHEELS=$TORCH_WHEELS"
    [ -n "$wheel" ] || fail "no torch-*+cpu-cp311 wheel in TORCH_WHEELS=$TORCH_WHEELS"
    version="$(basename "$wheel" | cut -d- -f2)"   # e.g. 2.13.0+cpu
    grep -qx "torch==${version%%+*}" "$ROOT/constraints.txt" \
        || fail "$wheel is torch $version; constraints.txt pins another torch"
    "$ENGINE" build --network host $BUILD_OPTS -f "$ROOT/deploy/Dockerfile" -t "$IMAGE" \
        --volume "$TORCH_WHEELS:/wheels:ro" \
        --build-arg BASE_IMAGE="$BASE" \
        --build-arg PYTHON_SOURCE=system \
        --build-arg TORCH_FIND_LINKS=/wheels \
        --build-arg TORCH_VERSION="$version" \
        --build-arg DS_ACCELERATOR=cpu \
        --build-arg USERDP_EXTRAS=peft \
        "$ROOT"
}

check() {  # the engine's own run; see tests/deploy/test_image.py for a whole job
    "$ENGINE" run --rm "$IMAGE" --version
}

case "${1:-all}" in
    base) base ;;
    build) build ;;
    check) check ;;
    all) base; build; check ;;
    *) fail "unknown action ${1}; expected base, build, check or all" ;;
esac

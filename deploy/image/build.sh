#!/usr/bin/env bash
# Builds the modelfleet image from Debian's and PyPI's packages only (no registry):
#   1. a Debian root filesystem with python3 (mmdebstrap), imported as
#      localhost/modelfleet-debian:bookworm;
#   2. modelfleet's wheel and its dependencies' (pip wheel '.[s3,gcs]') in
#      build/image/wheelhouse/;
#   3. podman build -f Containerfile with that folder as the context: the image
#      ${IMAGE:-localhost/modelfleet:0.1.0}.
# Steps 1 and 2 are kept between runs (delete build/image/ to redo them).
# Needs root (or rootful podman), mmdebstrap and podman: with INSTALL=1 it installs
# them from Debian's packages when missing. Exits 3 when they cannot be had.
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE="${IMAGE:-localhost/modelfleet:0.1.0}"
BASE="localhost/modelfleet-debian:bookworm"
PYTHON="${PYTHON:-.venv/bin/python}"
OUT=build/image

if ! command -v mmdebstrap >/dev/null 2>&1 || ! command -v podman >/dev/null 2>&1; then
    if [ "${INSTALL:-0}" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "image: installing mmdebstrap and podman from Debian's packages"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null || true
        apt-get install -y -qq mmdebstrap podman >/dev/null 2>&1 || true
    fi
    command -v mmdebstrap >/dev/null 2>&1 && command -v podman >/dev/null 2>&1 || {
        echo "image: mmdebstrap and podman are needed (apt-get install mmdebstrap podman)" >&2
        exit 3; }
fi
mkdir -p "$OUT"

if ! podman image exists "$BASE"; then
    if [ ! -f "$OUT/rootfs.tar" ] || [ ! -s "$OUT/rootfs.tar" ]; then
        echo "image: Debian root filesystem (mmdebstrap)"
        rm -rf "$OUT/rootfs.tar" "$OUT/rootfs.tar.partial"
        # --format=tar: mmdebstrap guesses the format from the name's extension, and
        # ".partial" would give a directory.
        mmdebstrap --quiet --format=tar --variant=minbase \
            --include=python3,python3-venv,ca-certificates bookworm "$OUT/rootfs.tar.partial"
        mv "$OUT/rootfs.tar.partial" "$OUT/rootfs.tar"
    fi
    podman import --quiet "$OUT/rootfs.tar" "$BASE" >/dev/null
fi

echo "image: wheels (pip wheel '.[s3,gcs]')"
rm -f "$OUT"/wheelhouse/modelfleet-*.whl  # this tree's, always afresh
"$PYTHON" -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$OUT/wheelhouse" \
    '.[s3,gcs]' \
    `# Debian's python3 is 3.11.2: redis needs this below 3.11.3, pip here may be newer` \
    'async-timeout>=4.0.3' 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

echo "image: podman build $IMAGE"
# Chroot isolation: the RUN steps need no cgroups or namespaces of their own (a build
# inside a container, on a host with hybrid cgroups, has neither to give).
podman build --quiet --format docker --isolation chroot --build-arg "BASE=$BASE" -f Containerfile -t "$IMAGE" \
    "$OUT"

#!/usr/bin/env bash
# Builds the modelfleet image from Debian's and PyPI's packages only (no registry):
#   1. a Debian root filesystem with python3 (mmdebstrap), imported as
#      localhost/modelfleet-debian:bookworm;
#   2. the dependencies' wheels (pip wheel '.[s3,gcs]') in build/image/deps/wheelhouse/,
#      modelfleet's own in build/image/app/;
#   3. the dependencies installed in a venv, an image of their own
#      (deploy/image/Containerfile.deps): localhost/modelfleet-deps:<digest of the
#      requirements and the wheels' names>, built only when that digest is new;
#   4. podman build -f Containerfile, FROM that image, with build/image/app/ as the
#      context: modelfleet's wheel added, the image ${IMAGE:-localhost/modelfleet:0.1.0}.
# Steps 1 to 3 are kept between runs (delete build/image/ and the images to redo them):
# a change to modelfleet's code rebuilds step 4 alone (~25 s less than installing every
# dependency again).
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
WHEELS="$OUT/deps/wheelhouse"
rm -f "$WHEELS"/modelfleet-*.whl
rm -rf "$OUT/app" && mkdir -p "$OUT/app" "$WHEELS"
"$PYTHON" -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$WHEELS" \
    '.[s3,gcs]' \
    `# Debian's python3 is 3.11.2: redis needs this below 3.11.3, pip here may be newer` \
    'async-timeout>=4.0.3' 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
mv "$WHEELS"/modelfleet-*.whl "$OUT/app/"  # this tree's, always afresh

# What modelfleet[s3,gcs] requires, resolved inside the image (Debian's python3) from the
# wheelhouse alone; the digest names the dependencies' image.
"$PYTHON" - > "$OUT/deps/requirements.txt" <<'PY'
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join([*project["dependencies"], *extras["s3"], *extras["gcs"],
                 "async-timeout>=4.0.3"]))
PY
DIGEST=$( (cat "$OUT/deps/requirements.txt" deploy/image/Containerfile.deps; \
           ls "$WHEELS") | sha256sum | cut -c1-16)
DEPS="localhost/modelfleet-deps:$DIGEST"
if ! podman image exists "$DEPS"; then
    echo "image: dependencies $DEPS (podman build -f deploy/image/Containerfile.deps)"
    podman build --quiet --format docker --isolation chroot --build-arg "BASE=$BASE" \
        -f deploy/image/Containerfile.deps -t "$DEPS" "$OUT/deps" >/dev/null
fi

echo "image: podman build $IMAGE"
# Chroot isolation: the RUN steps need no cgroups or namespaces of their own (a build
# inside a container, on a host with hybrid cgroups, has neither to give).
podman build --quiet --format docker --isolation chroot --build-arg "BASE=$BASE" \
    --build-arg "DEPS=$DEPS" -f Containerfile -t "$IMAGE" "$OUT/app"

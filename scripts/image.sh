#!/usr/bin/env bash
# Build the container image from ./Containerfile with Debian's buildah, on a Debian base made
# with debootstrap (this machine reaches no container registry, so no `python:` base can be
# pulled; a machine that can runs `make wheels && docker build .` instead).
#
#   scripts/image.sh [TAG]        # default localhost/outbox-relay:latest
#
# The base (Debian bookworm, minbase, python3 and its venv module, without package caches,
# documentation or translations) is made once and kept in buildah's storage as
# localhost/outbox-relay-base:bookworm; `buildah rmi` it to make it again. Needs root,
# debootstrap and buildah (Debian packages); the storage driver is vfs unless
# STORAGE_DRIVER says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${1:-localhost/outbox-relay:latest}
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-.venv/bin/python}
BASE=localhost/outbox-relay-base:$SUITE
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}

for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { echo "scripts/image.sh: $tool is not installed (apt-get install $tool)" >&2; exit 1; }
done

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  rootfs=$(mktemp -d /var/tmp/outbox-relay-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  echo "scripts/image.sh: making the base $BASE with debootstrap from $MIRROR" >&2
  if ! debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1; then
    tail -5 "$rootfs.log" >&2; echo "scripts/image.sh: debootstrap failed (whole log: $rootfs.log)" >&2; exit 1
  fi
  rm -f "$rootfs.log"
  rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* \
         "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
  ctr=$(buildah from scratch)
  buildah copy --quiet "$ctr" "$rootfs" / >/dev/null
  buildah commit --quiet "$ctr" "$BASE" >/dev/null
  buildah rm "$ctr" >/dev/null
fi

# The relay and every dependency as wheels, with this host's pip settings: the build reads
# no package index.
rm -rf dist/wheels
"$PYTHON" -m pip wheel --quiet --disable-pip-version-check '.[all,console,otel]' -w dist/wheels 2> >(grep -v "^WARNING: Location" >&2)
# The previous image of this tag goes first: with the vfs driver each one is a full copy.
buildah rmi --force "$TAG" >/dev/null 2>&1 || true
buildah bud --quiet --isolation chroot --layers=false --build-arg BASE="$BASE" -f Containerfile -t "$TAG" . >/dev/null
echo "scripts/image.sh: built $TAG ($(buildah images --format '{{.Size}}' "$TAG"))"

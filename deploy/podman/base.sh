#!/usr/bin/env bash
# A Debian bookworm base image with Python 3.11, made locally: for machines that reach Debian's
# package mirror but no container registry. Elsewhere build on the default base
# (python:3.11-slim-bookworm) and skip this script.
#
#   deploy/podman/base.sh [IMAGE]          # default localhost/debian:bookworm
#
# Does nothing when IMAGE already exists (PDSERVE_REBUILD_BASE=1 to make it again).
set -euo pipefail
image=${1:-localhost/debian:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

# One maker at a time (test sessions of several checkouts may start builds together).
exec 9>"/var/tmp/pdserve-base.lock"
flock 9
if podman image exists "$image" && [ -z "${PDSERVE_REBUILD_BASE:-}" ]; then
    echo "base image $image exists"
    exit 0
fi
root=$(mktemp -d "${TMPDIR:-/var/tmp}/pdserve-base.XXXXXX")
trap 'rm -rf "$root"' EXIT
# minbase has no Python: Debian's python3 (3.11 in bookworm, matching cp311 wheels) and venv.
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" "$mirror" \
    >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# No package lists, caches or docs in the image.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | podman import -q --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "base image $image made"

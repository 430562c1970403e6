#!/usr/bin/env bash
# Build the pdserve image with podman on a machine that reaches PyPI and Debian's mirror but no
# container registry (this project's machines and CI): the base is made with debootstrap
# (base.sh), torch is the CPU wheel from a local folder, pip trusts the host's CA certificates.
#
#   deploy/podman/build.sh [TAG]          # default localhost/pdserve:dev
#
# Environment: PDSERVE_BASE_IMAGE (default localhost/debian:bookworm, made by base.sh when
# missing), PDSERVE_WHEELS (folder holding the torch wheel; default /opt/wheels),
# PDSERVE_TORCH_SPEC (default torch==2.13.0+cpu), PDSERVE_EXTRA_PACKAGES, PDSERVE_MODELS (the
# built-in models made in the image; default "tiny smollm2").
set -euo pipefail
cd "$(dirname "$0")/../.."
tag=${1:-localhost/pdserve:dev}
base=${PDSERVE_BASE_IMAGE:-localhost/debian:bookworm}
wheels=${PDSERVE_WHEELS:-/opt/wheels}

[ "$base" != localhost/debian:bookworm ] || deploy/podman/base.sh "$base"
old=$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
# These machines refuse the default rlimits podman asks for; runc instead of crun.
limits=(--runtime runc --ulimit nofile=1024:4096 --ulimit nproc=1024:2048)
podman build "${limits[@]}" -f deploy/Containerfile -t "$tag" \
    --build-arg BASE_IMAGE="$base" \
    --build-arg TORCH_SPEC="${PDSERVE_TORCH_SPEC:-torch==2.13.0+cpu}" \
    --build-arg TORCH_INDEX_URL= \
    --build-arg TORCH_FIND_LINKS=/wheels \
    --build-arg EXTRA_PACKAGES="${PDSERVE_EXTRA_PACKAGES:-}" \
    --build-arg MODELS="${PDSERVE_MODELS:-tiny smollm2}" \
    --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    --build-arg BUILD_TAG="$tag" \
    -v /etc/ssl/certs:/etc/ssl/certs:ro \
    -v "$wheels":/wheels:ro \
    --layers --force-rm .
# The image this tag named before is left untagged: remove it (the layer cache stays).
new=$(podman image inspect --format '{{.Id}}' "$tag")
if [ -n "$old" ] && [ "$old" != "$new" ]; then podman rmi "$old" >/dev/null 2>&1 || true; fi
# So is the build stage's image (models, compiled kernels: ~1.9 GB a build), copied from and done
# with; what it was built on (the dependencies' layers) stays cached.
stage=$(podman images -q --filter "label=io.pdserve.build-stage-of=$tag" | sort -u)
[ -z "$stage" ] || podman rmi $stage >/dev/null 2>&1 || true
echo "built $tag ($(podman image inspect --format '{{.Size}}' "$tag" | numfmt --to=iec) bytes)"

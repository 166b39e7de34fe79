#!/bin/sh
# Builds the gateway image under `--engine gvisor` (Dockerfile.gvisor):
#   build-gvisor.sh BINARY RUNSC BASE TAG
# BINARY is a kernelgate build (stripped into the image), RUNSC the runsc to ship, BASE the
# kernel image (the gateway's Debian: no registry needed), TAG the image's name. Used by
# `make gateway-image-gvisor` and by tests/tests/gvisor_container.rs.
set -eu
[ $# -eq 4 ] || { echo "usage: $0 BINARY RUNSC BASE TAG" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
cp "$1" "$context/kernelgate"
strip "$context/kernelgate" 2>/dev/null || true
cp "$2" "$context/runsc"
cp "$here/Dockerfile.gvisor" "$here/gvisor-entrypoint.sh" "$context/"
DOCKER_BUILDKIT=0 docker build --quiet --build-arg BASE="$3" -f "$context/Dockerfile.gvisor" \
    -t "$4" "$context" >/dev/null
echo "built $4"

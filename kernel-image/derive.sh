#!/bin/bash
# Builds a kernel image derived from Kernelgate's with more Python packages, with no
# registry and no network inside the build: the wheels are fetched on this host first
# (`pip download`, or `pip wheel` for a local package directory), then
# `docker build --network=none` installs them with `pip install --no-index`.
#
# Usage: kernel-image/derive.sh -t TAG [-b BASE] [-n DISPLAY_NAME] [-l LOGO.png] REQUIREMENT...
#   REQUIREMENT   a PyPI requirement (`scikit-learn==1.5.2`) or a local package directory
#                 (its own dependencies must be listed too, or already be in the base)
#   -t TAG        the new image, e.g. kernelgate-sklearn:1
#   -b BASE       the image to derive from (default kernelgate-kernel:latest, `make image`)
#   -n NAME       the kernelspec display name launchers show (default: TAG)
#   -l LOGO.png   a 64x64 PNG logo for launchers
#
# Then: kernelgate serve --kernelspec sklearn=kernelgate-sklearn:1 [--pool-size sklearn=1]
#
# Environment: PYTHON (default python3), a Python with pip on this host; wheels for the
# image's Python (3.11, manylinux) are fetched whatever this host runs.
set -euo pipefail

die() { printf 'derive.sh: error: %s\n' "$*" >&2; exit 1; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tag= base=kernelgate-kernel:latest name= logo=
while getopts 't:b:n:l:' opt; do
    case $opt in
        t) tag=$OPTARG ;;
        b) base=$OPTARG ;;
        n) name=$OPTARG ;;
        l) logo=$OPTARG ;;
        *) die "usage: $0 -t TAG [-b BASE] [-n DISPLAY_NAME] [-l LOGO.png] REQUIREMENT..." ;;
    esac
done
shift $((OPTIND - 1))
[ -n "$tag" ] || die "give the new image's tag with -t, e.g. -t kernelgate-sklearn:1"
[ $# -ge 1 ] || die "give at least one requirement or package directory"
python=${PYTHON:-python3}
"$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip; set PYTHON to one that has"
docker image inspect "$base" >/dev/null 2>&1 || die "base image $base not found; build it with \`make image\`"

ctx=$(mktemp -d "${TMPDIR:-/tmp}/kernelgate-derive.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
mkdir "$ctx/wheels"
pip_quiet=(--disable-pip-version-check --no-input --quiet)
requirements=()
remote=()
for req in "$@"; do
    if [ -d "$req" ]; then
        # A local package: its wheel, built here; installed by its file name.
        before=$(ls "$ctx/wheels")
        "$python" -m pip wheel "${pip_quiet[@]}" --no-deps --wheel-dir "$ctx/wheels" "$req"
        built=$(comm -13 <(printf '%s\n' "$before") <(ls "$ctx/wheels") | head -n1)
        [ -n "$built" ] || die "no wheel was built from $req"
        requirements+=("/tmp/wheels/$built")
    else
        remote+=("$req")
        requirements+=("$req")
    fi
done
if [ ${#remote[@]} -gt 0 ]; then
    "$python" -m pip download "${pip_quiet[@]}" --dest "$ctx/wheels" --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 \
        --platform "manylinux2014_$(uname -m)" --platform "manylinux_2_28_$(uname -m)" \
        "${remote[@]}"
fi
logo_b64=
if [ -n "$logo" ]; then
    [ -f "$logo" ] || die "logo $logo not found"
    logo_b64=$(base64 -w0 "$logo")
fi
cp "$here/derived/Dockerfile" "$ctx/Dockerfile"
# The classic builder uses the local base image as it is; --network=none proves the
# install needs nothing from outside.
DOCKER_BUILDKIT=0 docker build --network=none --quiet \
    --build-arg "BASE=$base" \
    --build-arg "REQUIREMENTS=${requirements[*]}" \
    --build-arg "DISPLAY_NAME=${name:-$tag}" \
    --build-arg "LOGO_PNG=$logo_b64" \
    --label "org.kernelgate.base=$base" \
    -t "$tag" "$ctx" >/dev/null
printf 'derive.sh: built %s from %s with: %s\n' "$tag" "$base" "$*" >&2

#!/bin/bash
# Offline build of the kernel image: no container registry needed, only Debian's package
# mirror(s) configured on this host (read from apt at build time) and PyPI.
#
#   mmdebstrap (Debian bookworm, variant minbase, + python3 python3-venv tini)
#   -> setup-venv.sh in the chroot (user kernel 1000:1000, /opt/kernel/venv, trim, compileall)
#   -> tar -> docker import, with the config lines of ./Dockerfile as --change.
#
# Usage (as root): build-offline.sh IMAGE [EXTRA_TAG...]
#   e.g. build-offline.sh kernelgate-kernel:0123456789ab kernelgate-kernel:latest
# Normally run by `make image` (mk/image.mk), which computes the tag.
#
# Environment:
#   KERNELGATE_DEBIAN_SOURCES  newline-separated "deb URI SUITE COMPONENT" lines to use
#                              instead of the host's apt sources (bookworm suites only)
#   TMPDIR                     where the root filesystem and tarball are made (default
#                              /var/tmp; needs about 1.5 GB)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
suite=bookworm

log() { printf 'build-offline.sh: %s\n' "$*" >&2; }
die() { printf 'build-offline.sh: error: %s\n' "$*" >&2; exit 1; }

[ $# -ge 1 ] || die "usage: $0 IMAGE [EXTRA_TAG...]"
image=$1
shift
extra_tags=("$@")

[ "$(id -u)" -eq 0 ] || die "must run as root (mmdebstrap --mode=root, chroot)"
command -v docker >/dev/null || die "the docker CLI is not installed"
docker info >/dev/null 2>&1 ||
    die "Docker is not running: start it with \`systemctl start docker\` (or \`service docker start\`), then run \`make image\` again"

# --- tools -----------------------------------------------------------------------------------
apt_updated=0
ensure_package() { # ensure_package PACKAGE PATH-IT-PROVIDES
    [ -e "$2" ] && return 0
    log "installing $1 with apt-get"
    if [ "$apt_updated" -eq 0 ]; then
        apt-get update -qq
        apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$1" >/dev/null
    [ -e "$2" ] || die "installing $1 did not provide $2"
}
ensure_package mmdebstrap /usr/bin/mmdebstrap
ensure_package debian-archive-keyring /usr/share/keyrings/debian-archive-keyring.gpg
# Keeps bookworm's minbase from pulling usrmerge (and with it perl).
merged_usr_hooks=/usr/share/mmdebstrap/hooks/merged-usr
[ -d "$merged_usr_hooks" ] || die "$merged_usr_hooks is missing (mmdebstrap too old?)"

# --- package sources: the host's own mirrors, read now ----------------------------------------
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
sources=()
if [ -n "${KERNELGATE_DEBIAN_SOURCES:-}" ]; then
    while IFS= read -r line; do
        [ -n "$line" ] && sources+=("$line")
    done <<<"$KERNELGATE_DEBIAN_SOURCES"
else
    # One "deb" line per (site, release) of the bookworm family, main component only.
    while read -r site release; do
        sources+=("deb [signed-by=$keyring] $site $release main")
    done < <(apt-get indextargets --no-release-info --format '$(SITE) $(RELEASE) $(COMPONENT)' \
        'Identifier: Packages' |
        awk -v s="$suite" '$3 == "main" && ($2 == s || index($2, s "-") == 1) { print $1, $2 }' |
        sort -u)
fi
printf '%s\n' "${sources[@]}" | grep -Eq "[[:space:]]$suite[[:space:]]" ||
    die "no '$suite' suite among this host's apt sources; set KERNELGATE_DEBIAN_SOURCES='deb URI $suite main'"
for s in "${sources[@]}"; do log "source: $s"; done

# --- image config: the Dockerfile's ENV/USER/WORKDIR/ENTRYPOINT/CMD/LABEL lines ---------------
changes=()
while IFS= read -r line; do
    changes+=(--change "$line")
done < <(grep -E '^(ENV|USER|WORKDIR|ENTRYPOINT|CMD|LABEL)[[:space:]]' "$here/Dockerfile")
[ ${#changes[@]} -ge 20 ] || die "could not read the image config from $here/Dockerfile"
changes+=(--change "LABEL org.kernelgate.build=offline")

# --- root filesystem ------------------------------------------------------------------------
# /etc/resolv.conf and /etc/hostname (copied from the host by mmdebstrap) are removed: Docker
# provides both at run time. /run is cleaned by hand to keep the /run/kernel mount point.
workdir=$(mktemp -d "${TMPDIR:-/var/tmp}/kernelgate-image.XXXXXX")
cleanup() { rm -rf "$workdir"; }
trap cleanup EXIT

# pip in the chroot runs under `env -i`: host settings such as REQUESTS_CA_BUNDLE or PIP_CERT
# name files that do not exist there. The CA bundle the host trusts (which may include a
# TLS-intercepting proxy's CA) is copied in for the build instead and removed afterwards.
# Proxies and an index override pass.
chroot_env=(PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive)
host_ca=
for candidate in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
    if [ -n "$candidate" ] && [ -f "$candidate" ]; then host_ca=$candidate; break; fi
done
build_ca=/tmp/kernelgate-build-ca.pem # inside the chroot; /tmp is emptied before the tar
if [ -n "$host_ca" ]; then
    log "pip trusts the host's CA bundle $host_ca"
    cp "$host_ca" "$workdir/build-ca.pem"
    chroot_env+=("PIP_CERT=$build_ca")
fi
for var in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_INDEX_URL \
    PIP_EXTRA_INDEX_URL PIP_DEFAULT_TIMEOUT; do
    if [ -n "${!var:-}" ]; then chroot_env+=("$var=${!var}"); fi
done
setup_hook="chroot \"\$1\" /usr/bin/env -i $(printf '%q ' "${chroot_env[@]}")/bin/bash /opt/kernel/setup-venv.sh /usr/bin/python3"

log "building the root filesystem (mmdebstrap $suite minbase)"
TMPDIR=$workdir mmdebstrap \
    --mode=root --variant=minbase --format=tar --skip=output/dev \
    --hook-dir="$merged_usr_hooks" \
    --include=python3,python3-venv,tini \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/lintian/*' \
    --customize-hook='mkdir -p "$1/opt/kernel"' \
    --customize-hook="copy-in $(printf '%q ' "$here/requirements.txt" "$here/launch.py" "$here/kernelgate_state.py" "$here/setup-venv.sh")/opt/kernel" \
    --customize-hook='chmod 0644 "$1/opt/kernel/requirements.txt" "$1/opt/kernel/launch.py" "$1/opt/kernel/kernelgate_state.py"' \
    --customize-hook="if [ -f $(printf '%q' "$workdir/build-ca.pem") ]; then cp $(printf '%q' "$workdir/build-ca.pem") \"\$1$build_ca\"; fi" \
    --customize-hook="$setup_hook" \
    --customize-hook='rm -f "$1/opt/kernel/setup-venv.sh"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/cache/debconf/*-old "$1"/var/log/* "$1"/root/.cache "$1"/tmp/* "$1"/var/tmp/*' \
    --customize-hook='rm -f "$1/etc/resolv.conf" "$1/etc/hostname"' \
    --skip=cleanup/run \
    --customize-hook='find "$1/run" -mindepth 1 -maxdepth 1 ! -name lock ! -name kernel -exec rm -rf {} +' \
    "$suite" "$workdir/rootfs.tar" "${sources[@]}"

log "root filesystem: $(du -h "$workdir/rootfs.tar" | cut -f1)"
log "importing $image"
docker import "${changes[@]}" --message "kernelgate kernel image, offline build" \
    "$workdir/rootfs.tar" "$image" >/dev/null
for tag in "${extra_tags[@]}"; do
    docker tag "$image" "$tag"
done
log "done: $image$(printf ' %s' "${extra_tags[@]}")"

#!/bin/sh
# The entrypoint of the gateway image under `--engine gvisor` (Dockerfile.gvisor). runsc
# places each sandbox under /sys/fs/cgroup/<controller>/<path>, and a container runtime
# mounts there only the container's own cgroup of each cgroup v1 hierarchy (the mount's
# root is /docker/<id>, /kubepods/.../<id>). Each such mount is replaced by the whole
# hierarchy (the container is privileged and shares the host's cgroup namespace, as every
# cgroup v1 container does), so that `--cgroup-parent sibling` (the image's default) puts
# the sandboxes beside the container's cgroup: outside its memory limit, and outside what
# stopping the container kills. Under cgroup v2 nothing is changed (see docs/engines.md).
# Then the gateway: `kernelgate ARGS`.
set -eu
if [ ! -e /sys/fs/cgroup/cgroup.controllers ]; then
    # mountinfo: id parent dev root mount-point options [tags] - fstype source super-options
    awk '$5 ~ "^/sys/fs/cgroup/" && $4 != "/" {
        for (i = 7; $i != "-"; i++) ;
        if ($(i + 1) == "cgroup") print $5, $(i + 3)
    }' /proc/self/mountinfo |
        while read -r point options; do
            # The hierarchy's controllers (and name=): its super options but for rw/ro and
            # the release agent, which a mount of an existing hierarchy must not repeat.
            wanted=$(echo "$options" | tr , '\n' | grep -vE '^(rw|ro|release_agent=.*)$' | paste -sd, -)
            umount "$point"
            mount -t cgroup -o "$wanted" cgroup "$point"
        done
fi
exec /usr/local/bin/kernelgate "$@"

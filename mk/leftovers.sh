#!/usr/bin/env bash
# The last step of `make test`: fails when the tests left work of their own behind, i.e.
# kernel containers of a test gateway, sandboxes of the gVisor engine run for a test gateway
# (runsc processes on a test runtime directory's state root, runsc's state there), runtime
# directories and audit logs under /run/kg-* (with the engine's bundles and runsc state),
# temporary directories named kg-* or kgrun-*, or network namespaces named kg-*.
# Test gateways use runtime directories under /run/kg-* or $TMPDIR/kg*; a gateway started
# with `make run` (/run/kernelgate) is not the tests' and is not looked at.
# Only what appeared since STAMP (a file `make test` touches first) counts, so that what
# an earlier, interrupted run left does not fail this one.
set -u
stamp=${1:?usage: leftovers.sh STAMP}
since=$(stat -c %Y "$stamp")
tmp=${TMPDIR:-/tmp}
left=()
while read -r name dir created; do
    case "$dir" in
        /run/kg-*|"$tmp"/kg*) ;;
        *) continue ;;
    esac
    if [ "$(date -d "$created" +%s)" -ge "$since" ]; then
        left+=("container $name (runtime directory $dir)")
    fi
done < <(docker ps -a --format '{{.Names}} {{.Label "org.kernelgate.runtime_dir"}} {{.CreatedAt}}' | awk '{print $1, $2, $3" "$4" "$5}')
# The gVisor engine's sandboxes: runsc's processes name the state root of their gateway's
# runtime directory (`--root <dir>/gvisor/root`), which a test gateway keeps under a test
# directory; those started since the stamp count, whether or not the directory is still
# there (runsc removes a sandbox's cgroups with it).
now=$(date +%s)
while read -r pid age args; do
    root=$(sed -nE 's/.*--root[= ]([^ ]+).*/\1/p' <<<"$args")
    case "$root" in
        /run/kg-*|"$tmp"/kg*) ;;
        *) continue ;;
    esac
    if [ $((now - age)) -ge "$since" ]; then
        left+=("runsc process $pid (state root $root): ${args:0:80}")
    fi
done < <(ps -eo pid=,etimes=,args= | grep -E 'runsc(-sandbox|-gofer)? ' | grep -v grep)
shopt -s nullglob
for root in /run/kg-*/gvisor/root "$tmp"/kg*/gvisor/root; do
    for state in "$root"/*.state; do
        if [ "$(stat -c %Y "$state")" -ge "$since" ]; then
            left+=("runsc sandbox state $state")
        fi
    done
done
for path in /run/kg-* "$tmp"/kg-* "$tmp"/kgrun-*; do
    if [ "$(stat -c %Y "$path")" -ge "$since" ]; then
        left+=("path $path")
    fi
done
while read -r ns _; do
    case "$ns" in kg-*) left+=("network namespace $ns") ;; esac
done < <(ip netns list 2>/dev/null)
if [ ${#left[@]} -gt 0 ]; then
    echo "make test left work behind (each test must remove what it created, also when it fails):" >&2
    printf '  %s\n' "${left[@]}" >&2
    exit 1
fi
echo "leftovers: none (no test container, runsc sandbox, runtime directory, log or namespace left)"

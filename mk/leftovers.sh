#!/usr/bin/env bash
# The last step of `make test`: fails when the tests left work of their own behind, i.e.
# kernel containers of a test gateway, runtime directories and audit logs under /run/kg-*,
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
shopt -s nullglob
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
echo "leftovers: none (no test container, runtime directory, log or namespace left)"

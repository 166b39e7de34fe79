#!/usr/bin/env python3
"""Register gVisor's runsc with the Docker engine as the runtime `kernelgate-runsc`.

Idempotent: installs Debian's `runsc` package if it is missing, merges our runtime into
/etc/docker/daemon.json (every other key and runtime is kept), and reloads the engine
with SIGHUP, which running containers survive. Run as root (Docker access is root-equivalent).
See docs/security.md, "The second wall".

    python3 mk/gvisor-setup.py [--check]

--check only reports whether the runtime is registered (exit 0) or not (exit 1).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

RUNTIME = "kernelgate-runsc"
DAEMON_JSON = "/etc/docker/daemon.json"
# The arguments our kernels need, and why:
#   --network=none      kernels have no network anyway; no netstack is set up at all
#   --host-uds=create   the ZeroMQ ipc sockets on the bind-mounted socket directory are
#                       created inside the sandbox (bind) and used from the host
#   --platform=ptrace   the one platform without /dev/kvm (the default, stated anyway)
# No --oci-seccomp: the kernel's syscall filter is installed inside the sandbox by the
# image's launcher (kernel-image/launch.py), the same filter as under runc.
RUNTIME_ARGS = ["--network=none", "--host-uds=create", "--platform=ptrace"]


def registered() -> bool:
    out = subprocess.run(
        ["docker", "info", "--format", "{{json .Runtimes}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        sys.exit(f"error: `docker info` failed: {out.stderr.strip()}; is Docker running?")
    try:
        return RUNTIME in json.loads(out.stdout)
    except json.JSONDecodeError:
        return False


def install_runsc() -> str:
    path = shutil.which("runsc")
    if path:
        return path
    print("installing Debian's runsc package", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", "runsc"], check=True, env=env
    )
    path = shutil.which("runsc")
    if not path:
        sys.exit("error: runsc is not on PATH after installing it")
    return path


def merge_daemon_json(runsc: str) -> bool:
    """Add or update our runtime; True if the file changed."""
    try:
        with open(DAEMON_JSON, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        config = {}
    if not isinstance(config, dict):
        sys.exit(f"error: {DAEMON_JSON} is not a JSON object; fix it by hand first")
    runtimes = config.setdefault("runtimes", {})
    wanted = {"path": runsc, "runtimeArgs": RUNTIME_ARGS}
    if runtimes.get(RUNTIME) == wanted:
        return False
    runtimes[RUNTIME] = wanted
    directory = os.path.dirname(DAEMON_JSON)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".daemon.json.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, DAEMON_JSON)
    return True


def dockerd_pid() -> int:
    for path in ("/var/run/docker.pid", "/run/docker.pid"):
        try:
            with open(path, encoding="ascii") as f:
                return int(f.read().strip())
        except (FileNotFoundError, ValueError):
            continue
    out = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True, check=False)
    pids = out.stdout.split()
    if len(pids) != 1:
        sys.exit("error: cannot tell dockerd's PID; reload it yourself (kill -HUP <pid>)")
    return int(pids[0])


def main() -> None:
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if registered() else 1)
    if os.geteuid() != 0:
        sys.exit("error: run `make gvisor` as root: it installs a package and edits " + DAEMON_JSON)
    runsc = install_runsc()
    changed = merge_daemon_json(runsc)
    if changed or not registered():
        os.kill(dockerd_pid(), signal.SIGHUP)
        deadline = time.monotonic() + 30
        while not registered():
            if time.monotonic() > deadline:
                sys.exit(f"error: dockerd did not list {RUNTIME} after SIGHUP; see its log")
            time.sleep(0.2)
    version = subprocess.run([runsc, "--version"], capture_output=True, text=True, check=False)
    first = version.stdout.splitlines()[0] if version.stdout else "runsc"
    print(f"{RUNTIME} is registered with Docker ({first}, {' '.join(RUNTIME_ARGS)})")


if __name__ == "__main__":
    main()

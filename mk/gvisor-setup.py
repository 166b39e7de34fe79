#!/usr/bin/env python3
"""Register gVisor's runsc with the Docker engine: `kernelgate-runsc`, the fastest runsc and
platform this machine runs, and `kernelgate-runsc-ptrace`, Debian's own runsc on the ptrace
platform (the comparison, and the fallback an operator can pick with --runtime runsc-ptrace).

What it does, each step idempotent:

1. Installs Debian's `runsc` package if it is missing (never upgrades it: a running sandbox
   may use that binary).
2. Looks for a newer runsc in the host release's backports suite, on the Debian mirror the
   host's apt sources already name (the suite need not be in those sources: a private apt
   configuration under a temporary directory reads it). A newer one is unpacked with
   `dpkg-deb -x` into a directory of its own, named by version, under RUNSC_HOME; a version
   already unpacked there is used as it is and never overwritten.
3. Picks the platform: systrap when `runsc do` runs a command with it here, else ptrace.
4. Merges both runtimes into /etc/docker/daemon.json (every other key and runtime is kept)
   and reloads the engine with SIGHUP, which running containers survive. A container keeps
   the runsc binary it started with: registering a new path changes only new kernels.

Run as root (Docker access is root-equivalent). See docs/security.md: "Two walls with
gVisor" and "How it is set up".

    python3 mk/gvisor-setup.py [--check] [--offline]

--check   only reports whether both runtimes are registered (exit 0) or not (exit 1).
--offline skips the mirror: uses the newest runsc already unpacked, else Debian's.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

RUNTIME = "kernelgate-runsc"
PTRACE_RUNTIME = "kernelgate-runsc-ptrace"
RUNTIMES = (RUNTIME, PTRACE_RUNTIME)
DAEMON_JSON = "/etc/docker/daemon.json"
# Where newer runsc builds are unpacked, one directory per version.
RUNSC_HOME = "/usr/local/lib/kernelgate/runsc"
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# The arguments our kernels need, and why:
#   --network=none      kernels have no network anyway; no netstack is set up at all
#   --host-uds=create   the ZeroMQ ipc sockets on the bind-mounted socket directory are
#                       created inside the sandbox (bind) and used from the host
#   --platform=P        systrap or ptrace: the platforms that need no /dev/kvm
# No --oci-seccomp: the kernel's syscall filter is installed inside the sandbox by the
# image's launcher (kernel-image/launch.py), the same filter as under runc.
BASE_ARGS = ["--network=none", "--host-uds=create"]
PLATFORMS = ("systrap", "ptrace")


def say(msg: str) -> None:
    print(f"gvisor: {msg}", flush=True)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)


def registered_runtimes() -> dict:
    out = run(["docker", "info", "--format", "{{json .Runtimes}}"])
    if out.returncode != 0:
        sys.exit(f"error: `docker info` failed: {out.stderr.strip()}; is Docker running?")
    try:
        return json.loads(out.stdout) or {}
    except json.JSONDecodeError:
        return {}


def registered() -> bool:
    names = registered_runtimes()
    return all(name in names for name in RUNTIMES)


def debian_runsc() -> str:
    path = shutil.which("runsc")
    if path:
        return path
    say("installing Debian's runsc package")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", "runsc"], check=True, env=env
    )
    path = shutil.which("runsc")
    if not path:
        sys.exit("error: runsc is not on PATH after installing it")
    return path


def version_of(runsc: str) -> str:
    """`0.0~20240729.0` from `runsc version 0.0~20240729.0`, or '' if it does not run."""
    out = run([runsc, "--version"], timeout=30)
    first = out.stdout.splitlines()[0] if out.stdout else ""
    return first.split()[-1] if first.startswith("runsc version") else ""


def newer(a: str, b: str) -> bool:
    """Whether Debian version a is greater than b."""
    return run(["dpkg", "--compare-versions", a, "gt", b]).returncode == 0


# --- the host's Debian mirror, from its apt sources -----------------------------------


def codename() -> str:
    with open("/etc/os-release", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.strip().partition("=")
            if key == "VERSION_CODENAME":
                return value.strip('"')
    return ""


def apt_source_files(etc: str = "/etc/apt") -> list:
    paths = [os.path.join(etc, "sources.list")]
    parts = os.path.join(etc, "sources.list.d")
    if os.path.isdir(parts):
        paths += [os.path.join(parts, n) for n in sorted(os.listdir(parts))]
    return paths


def apt_sources(paths: list) -> list:
    """(uris, suites, components, signed_by) of every enabled `deb` source in `paths`:
    sources.list and *.list (one-line style), *.sources (deb822 style)."""
    found = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        if path.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line:
                        continue
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.split()
                if "deb" not in fields.get("types", []) or fields.get("enabled") == ["no"]:
                    continue
                signed = fields.get("signed-by", [""])[0]
                found.append(
                    (fields.get("uris", []), fields.get("suites", []),
                     fields.get("components", []), signed)
                )
        elif path.endswith(".list"):
            for line in text.splitlines():
                words = line.split("#")[0].split()
                if not words or words[0] != "deb":
                    continue
                words = words[1:]
                signed = ""
                if words and words[0].startswith("["):
                    options = []
                    while words:
                        options.append(words.pop(0))
                        if options[-1].endswith("]"):
                            break
                    for opt in " ".join(options).strip("[]").split():
                        if opt.startswith("signed-by="):
                            signed = opt.split("=", 1)[1]
                if len(words) >= 3:
                    found.append(([words[0]], [words[1]], words[2:], signed))
    return found


def debian_mirror(release: str, paths: list) -> tuple:
    """The (uri, keyring) of the Debian mirror that serves `release` main in `paths`."""
    for uris, suites, components, signed in apt_sources(paths):
        if release in suites and "main" in components and uris:
            return uris[0], signed or DEBIAN_KEYRING
    return "", ""


def fetch_backports(release: str, work: str) -> str:
    """Downloads runsc from `<release>-backports` into `work`; its path, or '' with the
    reason said."""
    uri, keyring = debian_mirror(release, apt_source_files())
    if not uri:
        say(f"no apt source serves {release} main; not looking for a newer runsc")
        return ""
    suite = f"{release}-backports"
    lists = os.path.join(work, "lists")
    cache = os.path.join(work, "cache")
    os.makedirs(os.path.join(lists, "partial"))
    os.makedirs(os.path.join(cache, "archives", "partial"))
    sources = os.path.join(work, "sources.list")
    with open(sources, "w", encoding="utf-8") as f:
        f.write(f"deb [signed-by={keyring}] {uri} {suite} main\n")
    opts = [
        "-o", f"Dir::Etc::SourceList={sources}",
        "-o", "Dir::Etc::SourceParts=/nonexistent",
        "-o", f"Dir::State::Lists={lists}",
        "-o", f"Dir::Cache={cache}",
        "-o", "APT::Sandbox::User=root",
        "-q",
    ]
    say(f"looking for runsc in {suite} (the mirror of the host's {release} sources)")
    update = run(["apt-get", *opts, "update"], timeout=300)
    if update.returncode != 0:
        say(f"cannot read {suite}: {update.stderr.strip().splitlines()[-1:]}")
        return ""
    download = run(["apt-get", *opts, "download", f"runsc/{suite}"], cwd=work, timeout=600)
    if download.returncode != 0:
        say(f"{suite} has no runsc to download: {download.stderr.strip().splitlines()[-1:]}")
        return ""
    debs = [n for n in os.listdir(work) if n.startswith("runsc_") and n.endswith(".deb")]
    return os.path.join(work, debs[0]) if debs else ""


def unpack(deb: str) -> str:
    """Unpacks the package into RUNSC_HOME/<version> unless that version is already there;
    returns its runsc."""
    version = run(["dpkg-deb", "-f", deb, "Version"]).stdout.strip()
    if not version:
        sys.exit(f"error: {deb} is not a Debian package")
    target = os.path.join(RUNSC_HOME, re.sub(r"[^A-Za-z0-9.+_-]", "_", version))
    binary = os.path.join(target, "usr", "bin", "runsc")
    if os.path.exists(binary):
        return binary
    os.makedirs(RUNSC_HOME, exist_ok=True)
    staging = tempfile.mkdtemp(dir=RUNSC_HOME, prefix=".unpacking-")
    subprocess.run(["dpkg-deb", "-x", deb, staging], check=True)
    os.chmod(staging, 0o755)
    os.rename(staging, target)
    say(f"unpacked runsc {version} into {target}")
    return binary


def unpacked() -> list:
    """Every runsc under RUNSC_HOME, as (version, path)."""
    found = []
    if os.path.isdir(RUNSC_HOME):
        for name in os.listdir(RUNSC_HOME):
            binary = os.path.join(RUNSC_HOME, name, "usr", "bin", "runsc")
            if not name.startswith(".") and os.access(binary, os.X_OK):
                version = version_of(binary)
                if version:
                    found.append((version, binary))
    return found


def platform_works(runsc: str, platform: str) -> bool:
    """Whether `runsc do` runs /bin/true on `platform` here (root; no network)."""
    with tempfile.TemporaryDirectory(prefix="kg-gvisor-probe-") as state:
        try:
            out = run(
                [runsc, f"--root={state}", f"--platform={platform}", "--network=none",
                 "do", "/bin/true"],
                timeout=60,
            )
        except subprocess.TimeoutExpired:
            return False
    return out.returncode == 0


# --- the engine's configuration --------------------------------------------------------


def merge_daemon_json(wanted: dict) -> bool:
    """Add or update our runtimes; True if the file changed."""
    try:
        with open(DAEMON_JSON, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        config = {}
    if not isinstance(config, dict):
        sys.exit(f"error: {DAEMON_JSON} is not a JSON object; fix it by hand first")
    runtimes = config.setdefault("runtimes", {})
    if all(runtimes.get(name) == spec for name, spec in wanted.items()):
        return False
    runtimes.update(wanted)
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
    out = run(["pidof", "dockerd"])
    pids = out.stdout.split()
    if len(pids) != 1:
        sys.exit("error: cannot tell dockerd's PID; reload it yourself (kill -HUP <pid>)")
    return int(pids[0])


def reload_engine(wanted: dict) -> None:
    os.kill(dockerd_pid(), signal.SIGHUP)
    deadline = time.monotonic() + 30
    while True:
        names = registered_runtimes()
        if all(names.get(n, {}).get("path") == spec["path"] for n, spec in wanted.items()):
            return
        if time.monotonic() > deadline:
            sys.exit(f"error: dockerd did not list {', '.join(wanted)} after SIGHUP; see its log")
        time.sleep(0.2)


def choose(debian: str, offline: bool) -> tuple:
    """The (runsc, version, origin) for kernelgate-runsc: the newest one here."""
    candidates = [(version_of(debian), debian, "Debian's package")]
    if not offline:
        with tempfile.TemporaryDirectory(prefix="kg-gvisor-apt-") as work:
            deb = fetch_backports(codename(), work)
            if deb:
                unpack(deb)
    candidates += [(v, p, f"{codename()}-backports, unpacked") for v, p in unpacked()]
    best = candidates[0]
    for candidate in candidates[1:]:
        if candidate[0] and newer(candidate[0], best[0]):
            best = candidate
    return best[1], best[0], best[2]


def main() -> None:
    args = sys.argv[1:]
    if args == ["--check"]:
        sys.exit(0 if registered() else 1)
    if args not in ([], ["--offline"]):
        sys.exit(__doc__)
    if os.geteuid() != 0:
        sys.exit("error: run `make gvisor` as root: it installs a package and edits " + DAEMON_JSON)
    debian = debian_runsc()
    runsc, version, origin = choose(debian, offline=args == ["--offline"])
    platform = next((p for p in PLATFORMS if platform_works(runsc, p)), "")
    if not platform and runsc != debian:
        say(f"runsc {version} runs on neither platform here; using Debian's")
        runsc, version, origin = debian, version_of(debian), "Debian's package"
        platform = "ptrace" if platform_works(debian, "ptrace") else ""
    if not platform:
        sys.exit(f"error: {runsc} cannot run a sandbox here (`runsc do /bin/true` fails)")
    wanted = {
        RUNTIME: {"path": runsc, "runtimeArgs": BASE_ARGS + [f"--platform={platform}"]},
        PTRACE_RUNTIME: {"path": debian, "runtimeArgs": BASE_ARGS + ["--platform=ptrace"]},
    }
    if merge_daemon_json(wanted) or not registered():
        reload_engine(wanted)
    say(f"{RUNTIME}: runsc {version} ({origin}, {runsc}) on the {platform} platform")
    say(f"{PTRACE_RUNTIME}: runsc {version_of(debian)} (Debian's package, {debian}) on ptrace")


if __name__ == "__main__":
    main()

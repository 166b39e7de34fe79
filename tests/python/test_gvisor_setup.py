"""`make gvisor` (mk/gvisor-setup.py): where it looks for a newer runsc, and that running it
again changes nothing: same daemon.json, same binaries, no reload.

The parsing tests use apt sources written to tmp_path. The mirror path (which mirror and suite
apt is asked for, the package unpacked into a directory of its own once, the newest version
chosen) runs the script's own functions on this machine's apt sources, with apt itself
replaced so nothing leaves the machine. The idempotency test runs the real script on this
machine, which `make test` has set up already (e2e-gvisor runs `make gvisor` first), as root
or through `sudo -n` as `make gvisor` does; it skips, saying why, when it can be neither or
when the two runtimes are not registered.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "mk" / "gvisor-setup.py"


def load_setup():
    spec = importlib.util.spec_from_file_location("gvisor_setup", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_mirror_comes_from_a_deb822_source_that_serves_the_release(tmp_path):
    setup = load_setup()
    (tmp_path / "sources.list").write_text("")
    parts = tmp_path / "sources.list.d"
    parts.mkdir()
    (parts / "debian.sources").write_text(
        "Types: deb-src\n"
        "URIs: http://source-only.example/debian\n"
        "Suites: bookworm\n"
        "Components: main\n"
        "\n"
        "Types: deb\n"
        "URIs: http://disabled.example/debian\n"
        "Suites: bookworm\n"
        "Components: main\n"
        "Enabled: no\n"
        "\n"
        "Types: deb\n"
        "URIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\n"
        "Components: main contrib\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        "\n"
        "Types: deb\n"
        "URIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\n"
        "Components: main\n"
    )
    paths = setup.apt_source_files(str(tmp_path))
    assert setup.debian_mirror("bookworm", paths) == (
        "http://mirror.example/debian",
        "/usr/share/keyrings/debian-archive-keyring.gpg",
    )
    assert setup.debian_mirror("trixie", paths) == ("", "")


def test_the_mirror_comes_from_a_one_line_source_with_its_keyring(tmp_path):
    setup = load_setup()
    (tmp_path / "sources.list").write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://source-only.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/etc/apt/keyrings/mirror.gpg] "
        "http://mirror.example/debian bookworm main non-free\n"
    )
    paths = setup.apt_source_files(str(tmp_path))
    assert setup.debian_mirror("bookworm", paths) == (
        "http://mirror.example/debian",
        "/etc/apt/keyrings/mirror.gpg",
    )
    # Without a signed-by option, Debian's own keyring checks the suite.
    (tmp_path / "sources.list").write_text("deb http://mirror.example/debian bookworm main\n")
    assert setup.debian_mirror("bookworm", paths)[1] == setup.DEBIAN_KEYRING


def engine_runtimes() -> dict:
    """The engine's runtimes, or a skip that says why they cannot be read."""
    out = subprocess.run(
        ["docker", "info", "--format", "{{json .Runtimes}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        pytest.skip(f"`docker info` failed, so the engine's runtimes are unknown: {out.stderr.strip()}")
    return json.loads(out.stdout or "{}") or {}


def registered_gvisor() -> dict:
    runtimes = engine_runtimes()
    if not {"kernelgate-runsc", "kernelgate-runsc-ptrace"} <= runtimes.keys():
        pytest.skip("gVisor is not set up here: run `make gvisor` (make test's e2e-gvisor does)")
    return runtimes


def as_make_gvisor_runs_it() -> list:
    """The command prefix `make gvisor` uses: nothing as root, else `sudo` (here `sudo -n`,
    which fails instead of asking for a password); a skip with the reason when neither works."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") is None:
        pytest.skip("not root and no sudo: `make gvisor` needs root (it edits /etc/docker/daemon.json)")
    probe = subprocess.run(["sudo", "-n", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(
            "not root and `sudo -n` needs a password here, so mk/gvisor-setup.py cannot run as "
            f"`make gvisor` runs it: {probe.stderr.strip()}"
        )
    return ["sudo", "-n"]


def fake_runsc_deb(root: Path, version: str) -> Path:
    """A Debian package holding a /usr/bin/runsc that reports `version`, built with dpkg-deb."""
    tree = root / "tree"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: runsc\nVersion: {version}-1~bpo12+1\nArchitecture: all\n"
        "Maintainer: tests <tests@localhost>\nDescription: a runsc that only says its version\n"
    )
    binary = tree / "usr" / "bin" / "runsc"
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!/bin/sh\necho 'runsc version {version}'\n")
    binary.chmod(0o755)
    deb = root / f"runsc_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(deb)], check=True,
                   capture_output=True)
    return deb


def test_the_mirror_path_on_this_machines_sources_asks_backports_and_unpacks_once(
    tmp_path, monkeypatch
):
    if shutil.which("dpkg-deb") is None or shutil.which("apt-get") is None:
        pytest.skip("not a Debian host: no dpkg-deb or apt-get, so no mirror path")
    setup = load_setup()
    release = setup.codename()
    uri, keyring = setup.debian_mirror(release, setup.apt_source_files())
    if not uri:
        pytest.skip(f"this machine's apt sources serve no {release!r} main, so there is no mirror to ask")
    # apt replaced: record what it is asked, and "download" a package into the work directory.
    version = "0.0~20990101.0"
    deb = fake_runsc_deb(tmp_path / "build", version)
    asked = []

    def fake_run(cmd, **kw):
        asked.append(cmd)
        if cmd[0] == "apt-get" and cmd[-1] == f"runsc/{release}-backports":
            shutil.copy(deb, Path(kw["cwd"]) / deb.name)
        return subprocess.run(["true"], capture_output=True, text=True, check=False)

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(setup, "run", fake_run)
    fetched = setup.fetch_backports(release, str(work))
    monkeypatch.undo()
    assert fetched == str(work / deb.name)
    # The suite asked for is this release's backports on the mirror the host's sources name,
    # checked with the keyring they name, through apt state of its own (not the host's lists).
    assert (work / "sources.list").read_text() == (
        f"deb [signed-by={keyring}] {uri} {release}-backports main\n"
    )
    updates = [c for c in asked if c[0] == "apt-get" and "update" in c]
    assert len(updates) == 1
    assert f"Dir::State::Lists={work / 'lists'}" in updates[0]
    assert "Dir::Etc::SourceParts=/nonexistent" in updates[0]

    # Unpacked into a directory of its own, named by version; a second time changes nothing.
    home = tmp_path / "runsc-home"
    monkeypatch.setattr(setup, "RUNSC_HOME", str(home))
    first = setup.unpack(fetched)
    # The directory is the package's version with what a file name should not hold replaced.
    directory = "0.0_20990101.0-1_bpo12+1"
    assert first == str(home / directory / "usr" / "bin" / "runsc")
    stat = os.stat(first)
    assert setup.unpack(fetched) == first
    again = os.stat(first)
    assert (again.st_ino, again.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert sorted(p.name for p in home.iterdir()) == [directory]

    # Offline, the newest runsc is the unpacked one, named with where it came from.
    debian = shutil.which("runsc")
    if debian is None:
        pytest.skip("Debian's runsc is not installed: nothing to choose between")
    assert setup.choose(debian, offline=True) == (first, version, f"{release}-backports, unpacked")


def test_make_gvisor_registered_the_backports_runsc_it_unpacked():
    """What `make gvisor` registered on this machine is what the mirror path leads to: the
    newest runsc unpacked from this release's backports, chosen again the same way offline."""
    setup = load_setup()
    runtimes = registered_gvisor()
    registered = runtimes["kernelgate-runsc"]["path"]
    debian = runtimes["kernelgate-runsc-ptrace"]["path"]
    if not registered.startswith(setup.RUNSC_HOME + "/"):
        pytest.skip(
            f"`make gvisor` registered {registered}, not a runsc unpacked from backports "
            "(the mirror had none newer, or was not reachable when it ran)"
        )
    release = setup.codename()
    uri, _ = setup.debian_mirror(release, setup.apt_source_files())
    assert uri, f"a backports runsc is registered, yet no apt source here serves {release} main"
    version = setup.version_of(registered)
    assert version and setup.newer(version, setup.version_of(debian)), (version, debian)
    assert setup.choose(debian, offline=True) == (
        registered,
        version,
        f"{release}-backports, unpacked",
    )


def test_running_it_again_changes_nothing_and_says_what_it_chose():
    prefix = as_make_gvisor_runs_it()
    before = registered_gvisor()
    chosen = before["kernelgate-runsc"]["path"]
    binary = os.stat(chosen)
    daemon = os.stat("/etc/docker/daemon.json")

    out = subprocess.run(
        [*prefix, sys.executable, str(SCRIPT), "--offline"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr

    # Nothing rewritten, nothing replaced under a running sandbox, the engine as it was.
    assert os.stat("/etc/docker/daemon.json").st_mtime_ns == daemon.st_mtime_ns
    after = os.stat(chosen)
    assert (after.st_ino, after.st_mtime_ns) == (binary.st_ino, binary.st_mtime_ns)
    assert engine_runtimes() == before

    # It says which runsc and platform each runtime has, as the engine has them.
    platform = next(
        a.split("=", 1)[1]
        for a in before["kernelgate-runsc"]["runtimeArgs"]
        if a.startswith("--platform=")
    )
    assert platform in ("systrap", "ptrace")
    lines = out.stdout.splitlines()
    assert any(
        line.startswith("gvisor: kernelgate-runsc: runsc ")
        and chosen in line
        and line.endswith(f"on the {platform} platform")
        for line in lines
    ), out.stdout
    assert before["kernelgate-runsc-ptrace"]["runtimeArgs"][-1] == "--platform=ptrace"
    assert any(line.startswith("gvisor: kernelgate-runsc-ptrace: runsc ") for line in lines)
    # Debian's runsc stays installed beside any newer one.
    assert Path(before["kernelgate-runsc-ptrace"]["path"]).is_file()

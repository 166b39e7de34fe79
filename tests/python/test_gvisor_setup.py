"""`make gvisor` (mk/gvisor-setup.py): where it looks for a newer runsc, and that running it
again changes nothing: same daemon.json, same binaries, no reload.

The parsing tests use apt sources written to tmp_path. The idempotency test runs the real
script on this machine, which `make test` has set up already (e2e-gvisor runs `make gvisor`
first); it needs root and is skipped without the two runtimes registered.
"""

from __future__ import annotations

import importlib.util
import json
import os
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
    out = subprocess.run(
        ["docker", "info", "--format", "{{json .Runtimes}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return json.loads(out.stdout or "{}") or {}


def test_running_it_again_changes_nothing_and_says_what_it_chose():
    if os.geteuid() != 0:
        pytest.skip("mk/gvisor-setup.py edits /etc/docker/daemon.json: root only")
    before = engine_runtimes()
    if not {"kernelgate-runsc", "kernelgate-runsc-ptrace"} <= before.keys():
        pytest.skip("gVisor is not set up here (`make gvisor`)")
    chosen = before["kernelgate-runsc"]["path"]
    binary = os.stat(chosen)
    daemon = os.stat("/etc/docker/daemon.json")

    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--offline"],
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

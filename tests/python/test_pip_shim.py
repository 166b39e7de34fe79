"""The in-kernel package installer (gateway/assets/packages) on its own, without Docker.

Each test builds a synced tree in tmp_path (lock.json and unpacked wheels), an allowlist and
a home, points the installer at them with its environment variables and runs this
interpreter as a kernel container would: `python -m pip ...` with the installer's directory
on PYTHONPATH.
"""

from __future__ import annotations

import errno
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "gateway" / "assets" / "packages"

HOW_TO_ADD = (
    "an operator allows it with `kernelgate packages add NAME --packages FILE`, fills the "
    "wheelhouse with `kernelgate packages sync --packages FILE --wheelhouse DIR`, then sends "
    "SIGHUP to the gateway"
)

# (normalized name, display name, version, files relative to the unpacked dir)
WHEELS = [
    ("kgfix-app", "kgfix-app", "1.0",
     {"kgfix_app/__init__.py": "import kgfix_dep\nVERSION = '1.0'\n"}),
    ("kgfix-dep", "kgfix-dep", "0.1", {"kgfix_dep.py": "DEP = 'dep 0.1'\n"}),
    ("kgfix-solo", "KgFix_Solo", "2.0", {"kgfix_solo.py": "SOLO = 'solo 2.0'\n"}),
]


def _metadata(display: str, version: str) -> str:
    return f"Metadata-Version: 2.1\nName: {display}\nVersion: {version}\nSummary: fixture\n"


def make_tree(tree: Path) -> None:
    packages = {}
    for key, display, version, files in WHEELS:
        unpacked = tree / f"{key}-{version}"
        for rel, text in files.items():
            (unpacked / rel).parent.mkdir(parents=True, exist_ok=True)
            (unpacked / rel).write_text(text)
        info = unpacked / f"{display.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(_metadata(display, version))
        packages[key] = {
            "name": display, "version": version, "in_image": False,
            "wheel": f"{key.replace('-', '_')}-{version}-py3-none-any.whl",
            "sha256": "0" * 64, "summary": "fixture", "dir": f"{key}-{version}",
        }
    # Locked, but its directory is not there.
    packages["kgfix-missing"] = dict(packages["kgfix-solo"], name="kgfix-missing",
                                     version="1.0", dir="kgfix-missing-1.0")
    packages["pytest"] = {"name": "pytest", "version": "1.0", "in_image": True}
    lock = {
        "format": 1,
        "image": "kernelgate-kernel:latest",
        "image_id": "sha256:" + "a" * 64,
        "python": {"version": "3.11.2", "implementation": "cp", "abi": "cp311",
                   "platforms": ["linux_x86_64"]},
        "synced_at": "2026-11-27T09:00:00Z",
        "requirements": {
            "kgfix-app": {"requirement": "kgfix-app", "packages": ["kgfix-app", "kgfix-dep"]},
            "kgfix-solo": {"requirement": "kgfix-solo", "packages": ["kgfix-solo"]},
            "kgfix-missing": {"requirement": "kgfix-missing", "packages": ["kgfix-missing"]},
        },
        "refused": [{"requirement": "kgfix-needs-numpy1",
                     "reason": "kgfix-needs-numpy1 needs numpy<2, the image has numpy 2.4.6"}],
        "packages": packages,
        "future_field": {"ignored": True},
    }
    (tree / "lock.json").write_text(json.dumps(lock))


class Kernel:
    """One kernel's view: its home, the synced tree, the allowlist and the report file."""

    def __init__(self, root: Path):
        self.root = root
        self.tree = root / "tree"
        self.home = root / "home"
        self.run_dir = root / "run"
        for d in (self.tree, self.home, self.run_dir):
            d.mkdir()
        make_tree(self.tree)
        self.allowed = root / "allowed.json"
        names = ["kgfix-app", "KgFix_Solo", "kgfix-missing", "kgfix-unsynced",
                 "kgfix-needs-numpy1"]
        self.allowed.write_text(json.dumps({
            "kernel_name": "python3",
            "entries": [{"name": n, "requirement": n} for n in names],
            "how_to_add": HOW_TO_ADD,
        }))
        self.report = self.run_dir / "installs.jsonl"
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "PYTHONPATH": str(SHIM),
            "PYTHONDONTWRITEBYTECODE": "1",
            "KERNELGATE_PACKAGES_TREE": str(self.tree),
            "KERNELGATE_PACKAGES_ALLOWED": str(self.allowed),
            "KERNELGATE_PACKAGES_REPORT": str(self.report),
        }

    def python(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args], env={**self.env, **env}, cwd=self.home,
            capture_output=True, text=True, timeout=60,
        )

    def pip(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return self.python("-m", "pip", *args, **env)

    @property
    def list_file(self) -> Path:
        return self.home / ".kernelgate-packages.json"

    def installed(self) -> list[dict]:
        if not self.list_file.exists():
            return []
        return json.loads(self.list_file.read_text())["installed"]

    def reports(self) -> list[dict]:
        if not self.report.exists():
            return []
        return [json.loads(line) for line in self.report.read_text().splitlines()]


@pytest.fixture
def kernel(tmp_path: Path) -> Kernel:
    return Kernel(tmp_path)


def lines(text: str) -> list[str]:
    return text.strip().splitlines()


def test_install_brings_its_dependency_and_is_importable(kernel: Kernel) -> None:
    r = kernel.pip("install", "kgfix-app")
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout) == [
        "Collecting kgfix-app",
        "Collecting kgfix-dep (from kgfix-app)",
        "Installing collected packages: kgfix-dep, kgfix-app",
        "Successfully installed kgfix-app-1.0 kgfix-dep-0.1",
    ]
    assert r.stderr == ""
    assert kernel.installed() == [
        {"name": "kgfix-dep", "version": "0.1", "dir": "kgfix-dep-0.1"},
        {"name": "kgfix-app", "version": "1.0", "dir": "kgfix-app-1.0"},
    ]
    [report] = kernel.reports()
    assert report["argv"] == ["pip", "install", "kgfix-app"]
    assert report["requested"] == ["kgfix-app"]
    assert report["installed"] == [{"name": "kgfix-dep", "version": "0.1"},
                                   {"name": "kgfix-app", "version": "1.0"}]
    assert report["refused"] == []
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", report["time"])

    # A fresh interpreter: metadata before the first import, then the import.
    r = kernel.python("-c", "import importlib.metadata as m, sys\n"
                      "print(m.version('kgfix-app'), m.version('kgfix_dep'))\n"
                      "import kgfix_app, kgfix_dep\n"
                      "print(kgfix_app.VERSION, kgfix_dep.DEP, kgfix_app.__file__)")
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout) == [
        "1.0 0.1",
        f"1.0 dep 0.1 {kernel.tree / 'kgfix-app-1.0' / 'kgfix_app' / '__init__.py'}",
    ]

    # Again: nothing to do, nothing reported.
    r = kernel.pip("install", "kgfix-app")
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout) == [
        f"Requirement already satisfied: kgfix-app in {kernel.tree / 'kgfix-app-1.0'} (1.0)",
        f"Requirement already satisfied: kgfix-dep in {kernel.tree / 'kgfix-dep-0.1'} "
        "(from kgfix-app) (0.1)",
    ]
    assert len(kernel.reports()) == 1


def test_names_are_normalized_and_the_console_script_reaches_the_shim(kernel: Kernel) -> None:
    # The venv's `pip` script does exactly this.
    r = kernel.python("-c", "import sys\nfrom pip._internal.cli.main import main\n"
                      "sys.argv = ['pip', 'install', 'KGFIX.solo>=2']\nsys.exit(main())")
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout)[-1] == "Successfully installed KgFix_Solo-2.0"
    assert kernel.installed() == [{"name": "KgFix_Solo", "version": "2.0",
                                   "dir": "kgfix-solo-2.0"}]


def test_a_package_in_the_image_is_already_satisfied(kernel: Kernel) -> None:
    dist = importlib.metadata.distribution("pytest")
    location = str(dist.locate_file("")).rstrip("/")
    r = kernel.pip("install", "pytest")
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout) == [
        f"Requirement already satisfied: pytest in {location} ({dist.version})"
    ]
    assert not kernel.list_file.exists()
    assert kernel.reports() == []

    # The image's version does not satisfy it, and pytest is not allowlisted.
    r = kernel.pip("install", "pytest<1")
    assert r.returncode == 1
    assert "ERROR: Package 'pytest' is not in this gateway's package allowlist" in r.stderr


def test_a_package_not_allowlisted_refuses_the_whole_install(kernel: Kernel) -> None:
    r = kernel.pip("install", "kgfix-app", "nosuchpkg")
    assert r.returncode == 1
    assert "Successfully installed" not in r.stdout
    assert lines(r.stderr) == [
        "ERROR: Package 'nosuchpkg' is not in this gateway's package allowlist, so it cannot "
        "be installed in this kernel (it has no network). An operator allows it with "
        "`kernelgate packages add NAME --packages FILE`, fills the wheelhouse with "
        "`kernelgate packages sync --packages FILE --wheelhouse DIR`, then sends SIGHUP to "
        "the gateway.",
        "Allowed packages: KgFix_Solo, kgfix-app, kgfix-missing, kgfix-needs-numpy1, "
        "kgfix-unsynced",
    ]
    assert not kernel.list_file.exists()
    [report] = kernel.reports()
    assert report["requested"] == ["kgfix-app", "nosuchpkg"]
    assert report["installed"] == []
    assert [r["requirement"] for r in report["refused"]] == ["nosuchpkg"]
    assert report["refused"][0]["reason"].startswith(
        "Package 'nosuchpkg' is not in this gateway's package allowlist")


def test_allowed_but_not_synced(kernel: Kernel) -> None:
    r = kernel.pip("install", "kgfix-unsynced")
    assert r.returncode == 1
    assert lines(r.stderr) == [
        "ERROR: Package 'kgfix-unsynced' is allowed but not synced for this kernel's image "
        "yet: an operator runs `kernelgate packages sync`."
    ]
    # In the lock, but its unpacked directory is missing.
    r = kernel.pip("install", "kgfix-missing")
    assert r.returncode == 1
    assert "ERROR: Package 'kgfix-missing' is allowed but not synced" in r.stderr
    # The sync refused it: the reason is shown too.
    r = kernel.pip("install", "kgfix-needs-numpy1")
    assert r.returncode == 1
    assert lines(r.stderr)[1] == ("The last sync refused it: kgfix-needs-numpy1 "
                                  "needs numpy<2, the image has numpy 2.4.6")
    assert not kernel.list_file.exists()


def test_the_locked_version_must_satisfy_the_specifier(kernel: Kernel) -> None:
    r = kernel.pip("install", "kgfix-app==2.0")
    assert r.returncode == 1
    assert lines(r.stderr) == [
        "ERROR: this gateway provides kgfix-app 1.0, which does not satisfy 'kgfix-app==2.0'."
    ]
    assert not kernel.list_file.exists()
    r = kernel.pip("install", "kgfix-app>=1,<2", "--no-deps")
    assert r.returncode == 0, r.stderr
    assert kernel.installed() == [{"name": "kgfix-app", "version": "1.0", "dir": "kgfix-app-1.0"}]


def test_without_packaging_only_names_and_exact_pins_are_checked(kernel: Kernel) -> None:
    broken = kernel.root / "nopackaging" / "packaging"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('no packaging here')\n")
    pythonpath = f"{SHIM}{os.pathsep}{broken.parent}"
    r = kernel.pip("install", "kgfix-app==2.0", PYTHONPATH=pythonpath)
    assert r.returncode == 1
    assert "which does not satisfy 'kgfix-app==2.0'" in r.stderr
    r = kernel.pip("install", "kgfix-app>=5", PYTHONPATH=pythonpath)
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout)[-1] == "Successfully installed kgfix-app-1.0 kgfix-dep-0.1"


def test_report_on_stdout(kernel: Kernel) -> None:
    r = kernel.pip("install", "-q", "--report", "-", "kgfix-app", "pytest")
    assert r.returncode == 0, r.stderr
    [line] = lines(r.stdout)
    assert json.loads(line) == {
        "installed": [{"name": "kgfix-dep", "version": "0.1"},
                      {"name": "kgfix-app", "version": "1.0"}],
        "already": [{"name": "pytest", "version": importlib.metadata.version("pytest")}],
        "refused": [],
    }
    r = kernel.pip("install", "--report", "-", "kgfix-solo", "nosuchpkg", "./x.whl")
    assert r.returncode == 1
    report = json.loads(lines(r.stdout)[-1])
    assert report["installed"] == []
    assert [x["requirement"] for x in report["refused"]] == ["nosuchpkg", "./x.whl"]
    assert "only allowlisted packages by name" in report["refused"][1]["reason"]


def test_paths_urls_and_builds_are_refused_other_options_ignored(kernel: Kernel) -> None:
    for args in (["./local.whl"], ["git+https://example.org/x.git"],
                 ["kgfix-app @ https://example.org/kgfix_app-1.0-py3-none-any.whl"],
                 ["--no-binary", ":all:", "kgfix-app"], ["--no-build-isolation", "kgfix-app"],
                 ["-e", "."]):
        r = kernel.pip("install", *args)
        assert r.returncode == 1, args
        assert "only allowlisted packages by name" in r.stderr, args
    assert not kernel.list_file.exists()

    r = kernel.pip("--disable-pip-version-check", "install", "--index-url",
                   "https://example.org/simple", "--user", "--no-cache-dir", "kgfix-solo")
    assert r.returncode == 0, r.stderr
    assert lines(r.stderr) == [
        "WARNING: ignoring --index-url, --user: packages come from this gateway's wheelhouse"
    ]

    requirements = kernel.home / "requirements.txt"
    requirements.write_text(
        "# pinned\n--index-url https://example.org/simple\n"
        "kgfix-app==1.0 --hash=sha256:" + "0" * 64 + "  # the app\n"
        'kgfix-unsynced; python_version < "3"\n'
    )
    r = kernel.pip("install", "-r", str(requirements))
    assert r.returncode == 0, r.stderr
    assert "Successfully installed kgfix-app-1.0 kgfix-dep-0.1" in r.stdout
    assert "Ignoring kgfix-unsynced: markers" in r.stdout


def test_an_install_by_another_process_is_seen_by_a_running_one(kernel: Kernel) -> None:
    running = subprocess.Popen(
        [sys.executable, "-c",
         "import importlib.metadata as m, sys\n"
         "try:\n    import kgfix_solo\nexcept ImportError:\n    print('missing', flush=True)\n"
         "sys.stdin.readline()\n"
         "print(m.version('kgfix-solo'), flush=True)\n"
         "import kgfix_solo\n"
         "print(kgfix_solo.SOLO, flush=True)\n"
         "print(sum(p.endswith('kgfix-solo-2.0') for p in sys.path), flush=True)\n"],
        env=kernel.env, cwd=kernel.home, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    try:
        assert running.stdout.readline() == "missing\n"
        r = kernel.pip("install", "kgfix-solo")
        assert r.returncode == 0, r.stderr
        out, err = running.communicate("go\n", timeout=30)
    finally:
        running.kill()
        running.wait()
    assert running.returncode == 0, err
    assert lines(out) == ["2.0", "solo 2.0", "1"]


def test_uninstall_list_show_and_version(kernel: Kernel) -> None:
    assert kernel.pip("install", "kgfix-app").returncode == 0

    r = kernel.pip("list", "--disable-pip-version-check")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^kgfix-app\s+1\.0$", r.stdout, re.M), r.stdout
    assert re.search(r"^kgfix-dep\s+0\.1$", r.stdout, re.M), r.stdout
    assert re.search(r"^pytest\s+", r.stdout, re.M), r.stdout

    r = kernel.pip("show", "kgfix-app")
    assert r.returncode == 0, r.stderr
    assert f"Location: {kernel.tree / 'kgfix-app-1.0'}" in r.stdout

    r = kernel.pip("--version")
    assert r.returncode == 0, r.stderr
    assert str(SHIM) not in r.stdout
    assert re.match(r"pip \d+\.", r.stdout)

    r = kernel.pip("uninstall", "-y", "kgfix-app", "nosuchpkg")
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout)[:3] == [
        "Found existing installation: kgfix-app 1.0",
        "Uninstalling kgfix-app-1.0:",
        "  Successfully uninstalled kgfix-app-1.0",
    ]
    # The rest goes to the real pip.
    assert "Skipping nosuchpkg as it is not installed" in r.stderr
    assert kernel.installed() == [{"name": "kgfix-dep", "version": "0.1", "dir": "kgfix-dep-0.1"}]
    r = kernel.python("-c", "import kgfix_app")
    assert r.returncode == 1
    assert "No module named 'kgfix_app'" in r.stderr


def test_a_full_home_leaves_the_list_unchanged(kernel: Kernel, tmp_path: Path) -> None:
    home = tmp_path / "smallhome"
    home.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(home)],
                             capture_output=True).returncode == 0
    try:
        kernel.env["HOME"] = str(home)
        kernel.home = home
        assert kernel.pip("install", "kgfix-solo").returncode == 0
        before = kernel.list_file.read_bytes()
        if mounted:
            with open(home / "filler", "wb", buffering=0) as filler:
                try:
                    while True:
                        filler.write(b"\0" * 4096)
                except OSError as err:
                    assert err.errno == errno.ENOSPC
            r = kernel.pip("install", "kgfix-app")
        else:
            # Not allowed to mount: the same failure, raised where the list is written.
            r = kernel.python(
                "-c",
                "import errno, os, runpy, sys\n"
                "def full(fd):\n    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
                "os.fsync = full\n"
                "sys.argv = ['pip', 'install', 'kgfix-app']\n"
                "runpy.run_module('pip', run_name='__main__')")
        assert r.returncode == 1
        assert lines(r.stderr) == [
            "ERROR: No space left in the kernel's home to record the install (0 MiB free); "
            "delete files and try again."
        ]
        assert "Successfully installed" not in r.stdout
        assert kernel.list_file.read_bytes() == before
        assert sorted(p.name for p in home.iterdir()) == sorted(
            [".kernelgate-packages.json"] + (["filler"] if mounted else []))
        report = kernel.reports()[-1]
        assert report["installed"] == []
        assert [x["requirement"] for x in report["refused"]] == ["kgfix-app"]
        assert report["refused"][0]["reason"].startswith("No space left in the kernel's home")
    finally:
        if mounted:
            subprocess.run(["umount", str(home)], check=True)


def test_interpreters_start_whatever_the_list_holds(kernel: Kernel) -> None:
    kernel.list_file.write_text("{not json")
    r = kernel.python("-c", "import sys; print(sys.meta_path[-1].__class__.__name__)")
    assert (r.returncode, r.stdout, r.stderr) == (0, "InstalledPackages\n", "")
    kernel.list_file.write_text(json.dumps({"installed": [
        {"name": "evil", "version": "1", "dir": "../../etc"},
        {"name": "kgfix-solo", "version": "2.0", "dir": "kgfix-solo-2.0"},
    ]}))
    r = kernel.python("-c", "import sys, kgfix_solo\n"
                      "print([p for p in sys.path if 'etc' in p or 'kgfix' in p])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == repr([str(kernel.tree / "kgfix-solo-2.0")])


def test_a_shadowed_sitecustomize_still_runs(kernel: Kernel) -> None:
    other = kernel.root / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITE = 1\n")
    r = kernel.python("-c", "print(OTHER_SITE)", PYTHONPATH=f"{SHIM}{os.pathsep}{other}")
    assert (r.returncode, r.stdout, r.stderr) == (0, "1\n", "")

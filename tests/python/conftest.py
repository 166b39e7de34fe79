"""Fixtures for the Python test suite: the real kernelgate binary, a real Jupyter Server or
JupyterLab pointed at it with --gateway-url, and Debian's headless Chromium through
Playwright.

Nothing here builds anything: `make python-tests` builds the gateway and the kernel image
first. Environment:
  KERNELGATE_BIN    the gateway binary (default <repo>/target/debug/kernelgate)
  KERNELGATE_IMAGE  the kernel image (default kernelgate-kernel:latest)
  KERNELGATE_LOG    the gateway's log filter (default kernelgate=debug,warn)
  KERNELGATE_ENGINE `gvisor`: every gateway on the gVisor engine (runsc driven directly, no
                    Docker), its images imported into the image store the Rust harness fills
                    (tests/src/engine.rs); else Docker, under KERNELGATE_RUNTIME
Every test gets <repo>/artifacts/<test name>/ for screenshots and the logs of the processes
it started.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from urllib.parse import urlparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
VENV_BIN = Path(sys.executable).parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessExited(AssertionError):
    """Raised by a wait_until check when the process it waits for is gone: no use waiting."""


LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}


def loopback_only(context) -> list[str]:
    """Lets a browser context reach loopback only: every other http(s)/ws(s) request is
    refused and its URL recorded in the returned list (which a test asserts is empty)."""
    outside: list[str] = []

    def guard(route):
        host = urlparse(route.request.url).hostname or ""
        if route.request.url.startswith(("http:", "https:", "ws:", "wss:")) and host not in LOOPBACK:
            outside.append(route.request.url)
            return route.abort()
        return route.continue_()

    context.route("**/*", guard)
    return outside


def wait_until(what: str, check: Callable[[], object], timeout: float, interval: float = 0.2):
    """Polls `check` until it returns something truthy; fails the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except ProcessExited:
            raise
        except Exception as e:  # noqa: BLE001 - reported below if it never succeeds
            last_error = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last_error!r})")


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> int | None:
    """SIGTERM, wait, then SIGKILL: only the process this suite started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = ANSI_ESCAPE.sub("", path.read_text(errors="replace"))
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Screens:
    """Numbered screenshots of a page into a test's artifacts directory."""

    def __init__(self, page, artifacts: Path):
        self.page = page
        self.artifacts = artifacts
        self.shots = 0

    def before_shot(self) -> None:
        """Hook: bring what the user should see into view."""

    def shot(self, name: str) -> Path:
        self.shots += 1
        path = self.artifacts / f"{self.shots:02d}-{name}.png"
        self.before_shot()
        self.page.screenshot(path=str(path))
        return path


class TokenServer:
    """A server on loopback that wants `Authorization: token ...` (needs url and token)."""

    request_timeout = 60

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[len("http") :]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    def request(self, method: str, path: str, **kw) -> requests.Response:
        kw.setdefault("timeout", self.request_timeout)
        return requests.request(method, self.url + path, headers=self.headers(), **kw)


@dataclass
class Gateway(TokenServer):
    """A running `kernelgate serve`."""

    url: str
    token: str
    runtime_dir: Path
    log_path: Path
    proc: subprocess.Popen = field(repr=False)

    def kernels(self) -> list[dict]:
        r = self.request("GET", "/api/kernels")
        assert r.status_code == 200, r.text
        return r.json()

    def log(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)


@pytest.fixture
def artifacts(request) -> Path:
    """<repo>/artifacts/<test name>/, emptied at the start of the test."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    path = ARTIFACTS / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def gateway_binary() -> Path:
    return Path(os.environ.get("KERNELGATE_BIN", REPO / "target" / "debug" / "kernelgate"))


def gvisor_engine() -> bool:
    """Whether this run's gateways run kernels on the gVisor engine (KERNELGATE_ENGINE=gvisor)."""
    return os.environ.get("KERNELGATE_ENGINE") == "gvisor"


# The image store the gVisor engine's tests fill, shared with the Rust harness
# (tests/src/engine.rs IMAGES) and kept between runs.
IMAGE_STORE = Path("/var/tmp/kernelgate-gvisor-images")


def image_store(images: list[str]) -> Path:
    """IMAGE_STORE holding each of `images`: saved from Docker with `docker save` and brought
    in with `kernelgate image import` unless the store has that image id under that name
    already (what tests/src/engine.rs does; the same lock file makes the two take turns)."""
    import fcntl

    binary = str(gateway_binary())
    with open(f"{IMAGE_STORE}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for image in images:
            inspect = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image],
                                     capture_output=True, text=True, check=False)
            if inspect.returncode != 0:
                pytest.fail(f"the image {image} is not in Docker: {inspect.stderr}")
            short = inspect.stdout.strip().removeprefix("sha256:")[:12]
            listed = subprocess.run([binary, "image", "--image-store", str(IMAGE_STORE), "list"],
                                    capture_output=True, text=True, check=False).stdout
            if any(short in line and image in line for line in listed.splitlines()):
                continue
            with tempfile.NamedTemporaryFile(dir="/var/tmp", suffix=".tar") as archive:
                subprocess.run(["docker", "save", "-o", archive.name, image], check=True)
                imported = subprocess.run(
                    [binary, "image", "--image-store", str(IMAGE_STORE), "import", archive.name],
                    capture_output=True, text=True, check=False)
                if imported.returncode != 0:
                    pytest.fail(f"kernelgate image import {image}: {imported.stderr}")
    return IMAGE_STORE


def engine_flags(image: str, extra: list[str]) -> list[str]:
    """The flags that put a gateway on this run's engine, as tests/src/lib.rs does: none under
    Docker; under the gVisor engine `--engine gvisor`, the image store holding the kernel image
    and the ones `extra` names (`--image`, `--kernelspec NAME=IMAGE`), and no kernel templates
    (each would be a sandbox more, booted at start), unless `extra` says otherwise."""
    if not gvisor_engine() or "--engine" in extra:
        return []
    flags = ["--engine", "gvisor"]
    if "--image-store" not in extra:
        images = [image]
        for flag, value in zip(extra, extra[1:]):
            if flag == "--image":
                images.append(value)
            elif flag == "--kernelspec" and "=" in value:
                images.append(value.split("=", 1)[1])
        flags += ["--image-store", str(image_store(images))]
    if "--kernel-templates" not in extra:
        flags += ["--kernel-templates", "false"]
    return flags


def runsc() -> str:
    """The runsc the engine runs (tests/src/engine.rs runsc): KERNELGATE_RUNSC, else the newest
    `make gvisor` unpacked, else /usr/bin/runsc."""
    if os.environ.get("KERNELGATE_RUNSC"):
        return os.environ["KERNELGATE_RUNSC"]
    found = sorted(Path("/usr/local/lib/kernelgate/runsc").glob("*/usr/bin/runsc"))
    return str(found[-1]) if found else "/usr/bin/runsc"


def start_gateway(log_path: Path, extra: list[str] | None = None) -> Gateway:
    binary = gateway_binary()
    if not binary.exists():
        pytest.fail(f"{binary} does not exist: run `cargo build -p kernelgate` (make python-tests does)")
    port = free_port()
    token = secrets.token_hex(16)
    # Short and unique: the gateway removes leftover containers of its runtime dir at start,
    # and the kernel socket paths under it must stay within the Unix socket limit.
    runtime_dir = Path(f"/run/kg-py-{port}-{secrets.token_hex(2)}")
    image = os.environ.get("KERNELGATE_IMAGE", "kernelgate-kernel:latest")
    args = [
        str(binary),
        "serve",
        "--listen",
        f"127.0.0.1:{port}",
        "--token",
        token,
        "--image",
        image,
        "--runtime-dir",
        str(runtime_dir),
    ]
    # `{port}` in a flag stands for the port it listens on (a cluster node's --advertise).
    extra = [a.replace("{port}", str(port)) for a in (extra or [])]
    extra = engine_flags(image, extra) + extra
    if "--pool-size" not in extra:
        extra += ["--pool-size", "0"]
    if "--hibernate-dir" not in extra:
        # Beside the runtime directory, removed with it.
        extra += ["--hibernate-dir", f"{runtime_dir}.hibernated"]
    if "--audit-log" not in extra:
        # Beside the gateway's log, not in the host's /var/log.
        extra += ["--audit-log", str(log_path.with_name(log_path.stem + "-audit.log"))]
    env = dict(os.environ)
    env.setdefault("KERNELGATE_LOG", "kernelgate=debug,warn")
    env["NO_COLOR"] = "1"  # a plain log file
    log = open(log_path, "ab")
    proc = subprocess.Popen(args + extra, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    gw = Gateway(f"http://127.0.0.1:{port}", token, runtime_dir, log_path, proc)

    def serving():
        if proc.poll() is not None:
            raise ProcessExited(f"gateway exited with {proc.returncode}:\n{gw.log()}")
        return requests.get(gw.url + "/api", headers=gw.headers(), timeout=2).status_code == 200

    try:
        wait_until("the gateway to serve GET /api", serving, timeout=30)
    except BaseException:
        stop_process(proc)
        raise
    return gw


@pytest.fixture
def gateway(artifacts: Path) -> Iterator[Gateway]:
    """The real gateway binary on a free loopback port, random token, own runtime dir, no
    warm pool. Its log goes to artifacts/<test>/gateway.log. Stopped with SIGTERM (it removes
    its kernel containers)."""
    gw = start_gateway(artifacts / "gateway.log")
    yield gw
    stop_gateway(gw)


# The execution policy of `policy_gateway` and the other suites that run with one: the one
# the Rust tests and the bench use (format: docs/policy.md).
POLICY = (REPO / "tests" / "fixtures" / "policy.toml").read_text()


@pytest.fixture
def policy_gateway(artifacts: Path, tmp_path: Path) -> Iterator[Gateway]:
    """Like `gateway`, with the execution policy POLICY in force."""
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    gw = start_gateway(artifacts / "gateway.log", ["--policy", str(policy)])
    yield gw
    stop_gateway(gw)


def stop_gateway(gw: Gateway) -> None:
    code = stop_process(gw.proc, timeout=30)
    remove_leftovers(gw.runtime_dir)
    assert code == 0, f"gateway exited with {code} on SIGTERM:\n{gw.log()}"


def remove_leftovers(runtime_dir: Path) -> None:
    """Removes what a gateway on `runtime_dir` may have left (nothing, after a clean stop; a
    failed test's gateway may not have stopped cleanly): its containers, the mounts below the
    directory, the directory, its hibernated kernels' state. Every test leaves the machine
    as it found it."""
    shutil.rmtree(f"{runtime_dir}.hibernated", ignore_errors=True)
    # The gVisor engine's sandboxes: `delete -force` kills one from outside, so one whose
    # kernel no longer answers signals goes too.
    root = runtime_dir / "gvisor" / "root"
    if root.exists():
        out = subprocess.run([runsc(), "--root", str(root), "list", "-format=json"],
                             capture_output=True, text=True, check=False).stdout
        try:
            sandboxes = json.loads(out or "null") or []
        except ValueError:
            sandboxes = []
        for sandbox in sandboxes:
            subprocess.run([runsc(), "--root", str(root), "delete", "-force", sandbox["id"]],
                           capture_output=True, check=False)
    listed = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=org.kernelgate.runtime_dir={runtime_dir}"],
        capture_output=True, text=True, check=False,
    ).stdout.split()
    if listed:
        subprocess.run(["docker", "rm", "-f", *listed], capture_output=True, check=False)
    below = f"{runtime_dir}/"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1]
        if point.startswith(below):
            subprocess.run(["umount", point], capture_output=True, check=False)
    shutil.rmtree(runtime_dir, ignore_errors=True)


@dataclass
class JupyterServer(TokenServer):
    """A local Jupyter Server (or JupyterLab) whose kernels live on a gateway."""

    url: str
    token: str
    root_dir: Path
    log_path: Path
    proc: subprocess.Popen = field(repr=False)
    request_timeout = 90

    def log(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)


# JupyterLab settings for a machine that reaches nothing but loopback: no news, no update
# check, no extension manager listing (each would try the internet).
LAB_USER_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


def start_jupyter(
    app: str, gateway: Gateway, workdir: Path, log_path: Path, extra: list[str] | None = None
) -> JupyterServer:
    """Starts `jupyter <app> --gateway-url=<gateway>` ("lab" or "server") on a free loopback
    port with its own token, a root dir under `workdir` (notebook files stay local) and Jupyter
    config/data/runtime dirs of its own, so nothing on the host changes what it does. The
    gateway token goes the way jupyter_server's GatewayClient reads it: the env variable
    JUPYTER_GATEWAY_AUTH_TOKEN (the trait GatewayClient.auth_token)."""
    port = free_port()
    token = secrets.token_hex(16)
    root = workdir / "root"
    jdirs = {name: workdir / name for name in ("config", "data", "runtime", "settings", "workspaces")}
    for d in [root, *jdirs.values()]:
        d.mkdir(parents=True, exist_ok=True)
    for rel, value in LAB_USER_SETTINGS.items():
        p = jdirs["settings"] / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(value))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "JPY_"))}
    env.update(
        JUPYTER_CONFIG_DIR=str(jdirs["config"]),
        JUPYTER_DATA_DIR=str(jdirs["data"]),
        JUPYTER_RUNTIME_DIR=str(jdirs["runtime"]),
        JUPYTER_PLATFORM_DIRS="1",
        JUPYTER_GATEWAY_AUTH_TOKEN=gateway.token,
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    args = [
        str(VENV_BIN / "jupyter"),
        app,
        f"--gateway-url={gateway.url}",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.open_browser=False",
        "--ServerApp.allow_root=True",  # CI runs as root
        "--ServerApp.log_level=DEBUG",
        # The first kernel start pulls nothing but may wait for a container on a busy machine.
        "--GatewayClient.request_timeout=90",
        "--GatewayClient.connect_timeout=60",
    ]
    if app == "lab":
        args += [
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            f"--LabApp.user_settings_dir={jdirs['settings']}",
            f"--LabApp.workspaces_dir={jdirs['workspaces']}",
        ]
    args += list(extra or [])
    log = open(log_path, "ab")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    log.close()
    server = JupyterServer(f"http://127.0.0.1:{port}", token, root, log_path, proc)

    def serving():
        if proc.poll() is not None:
            raise ProcessExited(f"jupyter {app} exited with {proc.returncode}:\n{server.log()}")
        return server.request("GET", "/api/status", timeout=2).status_code == 200

    try:
        wait_until(f"jupyter {app} to serve /api/status", serving, timeout=90)
    except BaseException:
        stop_process(proc)
        raise
    return server


@pytest.fixture
def jupyter_factory(artifacts: Path, tmp_path: Path) -> Iterator[Callable[..., JupyterServer]]:
    """`jupyter_factory(app, gateway)` starts `jupyter lab` or `jupyter server` with
    --gateway-url; its log goes to artifacts/<test>/jupyter-<app>.log. Stopped at teardown."""
    started: list[JupyterServer] = []

    def start(app: str, gateway: Gateway, extra: list[str] | None = None) -> JupyterServer:
        workdir = Path(tempfile.mkdtemp(prefix=f"jupyter-{app}-", dir=tmp_path))
        server = start_jupyter(app, gateway, workdir, artifacts / f"jupyter-{app}.log", extra)
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        stop_process(server.proc)


@pytest.fixture(scope="session")
def chromium():
    """Debian's headless Chromium driven by Playwright (its own browser download is never
    used: it cannot be fetched here)."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make python-venv` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()

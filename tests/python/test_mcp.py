"""The MCP server, driven by the official Python `mcp` client against the real gateway and
Docker: over Streamable HTTP (`/mcp`) in the client's default mode (2026-07-28: no session,
kernels by `start_kernel` handle) and with the classic `initialize` handshake (a session
with its own kernel), and over stdio (`kernelgate mcp`, one session per process) in both
modes. The gateway and `kernelgate mcp` run at their default limits (the output cap, the
MCP result budget), as a user's would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Iterator

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from conftest import ARTIFACTS, POLICY, REPO, Gateway, start_gateway, stop_gateway, wait_until

EXPECTED_TOOLS = {"run_python", "list_files", "read_file", "write_file", "install_packages", "restart_kernel",
                  "start_kernel", "snapshot_kernel", "fork_kernel"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Two tenants besides the admin token, for the ownership tests.
ALICE, BOB = secrets.token_hex(16), secrets.token_hex(16)


@pytest.fixture(scope="module")
def gw(tmp_path_factory) -> Iterator[Gateway]:
    """One gateway for the module: a warm pool of 2, two keys (alice, bob) besides the admin
    token, conftest's execution policy and an audit log of its own; default limits."""
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(
        "".join(
            f'[[key]]\nname = "{name}"\ntoken_sha256 = "{hashlib.sha256(t.encode()).hexdigest()}"\n\n'
            for name, t in (("alice", ALICE), ("bob", BOB))
        )
    )
    logs = ARTIFACTS / "test_mcp"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    policy = logs / "policy.toml"
    policy.write_text(POLICY)
    gateway = start_gateway(logs / "gateway.log", [
        "--pool-size", "2", "--keys", str(keys), "--policy", str(policy), "--audit-log", str(logs / "audit.log")])
    yield gateway
    stop_gateway(gateway)
    shutil.rmtree(STDIO_BASE, ignore_errors=True)  # the emptied runtime dirs of `kernelgate mcp`


def client(gw: Gateway, mode: str = "auto", token: str | None = None) -> Client:
    """An MCP client of `/mcp`: mode "auto" (the client's default: 2026-07-28 when the server
    speaks it) or "legacy" (the initialize handshake, with a session)."""
    http = create_mcp_http_client(headers={"Authorization": f"token {token or gw.token}"})
    c = Client(streamable_http_client(gw.url + "/mcp", http_client=http), mode=mode, read_timeout_seconds=120)
    c.server_http = http  # for tests that watch the HTTP exchanges
    return c


# `kernelgate mcp` processes keep their runtime directories under this one.
STDIO_BASE = Path(f"/run/kg-mcp-{secrets.token_hex(3)}")


BINARY = Path(os.environ.get("KERNELGATE_BIN", REPO / "target" / "debug" / "kernelgate"))


def stdio_client(mode: str = "auto", gateway: Gateway | None = None, token: str | None = None,
                 token_file: Path | None = None) -> Client:
    """A client that launches `kernelgate mcp`: on the local Docker engine, or with
    `--url` on `gateway`'s kernels (the token given with `--token`, or in `token_file`)."""
    binary = BINARY
    if gateway is None:
        args = ["mcp", "--runtime-dir", str(STDIO_BASE), "--audit-log", str(ARTIFACTS / "test_mcp" / "stdio-audit.log"),
                "--policy", str(ARTIFACTS / "test_mcp" / "policy.toml")]
    elif token_file is not None:
        args = ["mcp", "--url", gateway.url, "--token-file", str(token_file)]
    else:
        args = ["mcp", "--url", gateway.url, "--token", token or gateway.token]
    params = StdioServerParameters(
        command=str(binary),
        args=args,
        env={
            "KERNELGATE_IMAGE": os.environ.get("KERNELGATE_IMAGE", "kernelgate-kernel:latest"),
            "KERNELGATE_RUNTIME": os.environ.get("KERNELGATE_RUNTIME", "runc"),
            "KERNELGATE_LOG": "kernelgate=info,warn",
            "NO_COLOR": "1",
        },
    )
    return Client(params, mode=mode, read_timeout_seconds=120)


def stdio_containers() -> set[str]:
    """Kernel ids of the running containers of `kernelgate mcp` processes."""
    out = subprocess.run(
        ["docker", "ps", "--filter", "label=org.kernelgate.kernel_id",
         "--format", '{{.Label "org.kernelgate.runtime_dir"}} {{.Label "org.kernelgate.kernel_id"}}'],
        capture_output=True, text=True, check=True,
    ).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith(str(STDIO_BASE) + "/")}


@asynccontextmanager
async def connected(gw: Gateway, mode: str, token: str | None = None, transport: str = "http") -> AsyncIterator[tuple[Client, dict]]:
    """A connected client and the arguments that pick its kernel: none in a session (the
    classic handshake over HTTP, always over stdio), the kernel_id of start_kernel without."""
    if transport == "stdio":
        c = stdio_client(mode)
    elif transport == "stdio-url":
        c = stdio_client(mode, gateway=gw, token=token)
    else:
        c = client(gw, mode, token)
    async with c:
        target: dict = {}
        if mode != "legacy" and transport == "http":
            started = await c.call_tool("start_kernel", {})
            assert not started.is_error, text(started)
            target = {"kernel_id": started.structured_content["kernel_id"]}
        yield c, target


def text(result) -> str:
    return "\n".join(c.text for c in result.content if getattr(c, "type", "") == "text")


def run(coro):
    """Runs a scenario to its end on an event loop of its own, in a thread of its own: tests
    run before it (Playwright's sync API, schemathesis) may leave a loop in the main thread,
    where asyncio.run() refuses to start."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def containers(gw: Gateway) -> set[str]:
    """Kernel ids of this gateway's running containers."""
    out = subprocess.run(
        ["docker", "ps", "--filter", f"label=org.kernelgate.runtime_dir={gw.runtime_dir}",
         "--format", '{{.Label "org.kernelgate.kernel_id"}}'],
        capture_output=True, text=True, check=True,
    ).stdout
    return set(out.split())


MODES = ["auto", "legacy"]
# (transport, mode): both protocol modes over HTTP, over stdio, and over stdio with --url.
WAYS = [("http", "auto"), ("http", "legacy"), ("stdio", "auto"), ("stdio", "legacy"),
        ("stdio-url", "auto"), ("stdio-url", "legacy")]
WAY_IDS = [f"{t}-{m}" for t, m in WAYS]


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_negotiated_protocol_and_tool_list(gw: Gateway, transport: str, mode: str):
    async def scenario():
        c = {"stdio": lambda: stdio_client(mode), "stdio-url": lambda: stdio_client(mode, gateway=gw)}.get(
            transport, lambda: client(gw, mode))()
        async with c:
            tools = await c.list_tools()
            names = {t.name for t in tools.tools}
            assert names == EXPECTED_TOOLS
            run_python = next(t for t in tools.tools if t.name == "run_python")
            assert run_python.input_schema["required"] == ["code"]
            assert "persist" in run_python.description
            install = next(t for t in tools.tools if t.name == "install_packages")
            assert install.input_schema["required"] == ["packages"]
            assert "allowlist" in install.description
            return c.protocol_version

    version = run(scenario())
    if mode == "auto":
        assert version == "2026-07-28"
    else:
        assert version < "2026-07-28"


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_variables_persist_between_calls(gw: Gateway, transport: str, mode: str):
    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            first = await c.call_tool("run_python", {"code": "x = 41", **target})
            assert not first.is_error, text(first)
            second = await c.call_tool("run_python", {"code": "print('hi'); x + 1", **target})
            assert not second.is_error, text(second)
            assert text(second).split() == ["hi", "42"]

    run(scenario())


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_matplotlib_chart_is_png_image_content(gw: Gateway, transport: str, mode: str):
    code = (
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\n"
        "plt.title('squares')\n"
        "plt.show()\n"
    )

    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            result = await c.call_tool("run_python", {"code": code, **target})
            assert not result.is_error, text(result)
            images = [b for b in result.content if b.type == "image"]
            assert len(images) == 1, result.content
            assert images[0].mime_type == "image/png"
            assert base64.b64decode(images[0].data).startswith(PNG_MAGIC)

    run(scenario())


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_exception_is_a_tool_error_with_traceback(gw: Gateway, transport: str, mode: str):
    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            result = await c.call_tool("run_python", {"code": "y = 1\n1/0", **target})
            assert result.is_error
            message = text(result)
            assert message.startswith("ZeroDivisionError: division by zero")
            assert "\x1b[" not in message, "ANSI colours must be stripped"
            assert "1/0" in message  # the traceback
            after = await c.call_tool("run_python", {"code": "y", **target})
            assert text(after) == "1"

    run(scenario())


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_cancelled_call_returns_promptly_and_state_survives(gw: Gateway, transport: str, mode: str):
    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            await c.call_tool("run_python", {"code": "x = 'kept'", **target})
            started = time.monotonic()
            with anyio.move_on_after(3) as scope:
                await c.call_tool("run_python", {"code": "import time; time.sleep(60)", **target})
            assert scope.cancelled_caught
            assert time.monotonic() - started < 10
            # The kernel was interrupted: the next call runs at once and still sees x.
            t0 = time.monotonic()
            after = await c.call_tool("run_python", {"code": "x", **target})
            assert text(after) == "'kept'", text(after)
            assert time.monotonic() - t0 < 20

    run(scenario())


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_files_written_by_code_and_by_the_tool(gw: Gateway, transport: str, mode: str):
    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            made = await c.call_tool("run_python", {"code": "open('out.txt', 'w').write('from code\\n')", **target})
            assert not made.is_error, text(made)
            read = await c.call_tool("read_file", {"path": "out.txt", **target})
            assert not read.is_error, text(read)
            assert text(read) == "from code\n"

            wrote = await c.call_tool("write_file", {"path": "data/in.csv", "content": "a,b\n1,2\n", **target})
            assert not wrote.is_error, text(wrote)
            seen = await c.call_tool("run_python", {"code": "import pandas as pd; int(pd.read_csv('data/in.csv').b.sum())", **target})
            assert text(seen) == "2"
            frame = await c.call_tool("run_python", {"code": "pd.read_csv('data/in.csv')", **target})
            assert text(frame) == "   a  b\n0  1  2", text(frame)  # its text/plain, not HTML

            binary = base64.b64encode(bytes(range(256))).decode()
            await c.call_tool("write_file", {"path": "blob.bin", "content": binary, "encoding": "base64", **target})
            back = await c.call_tool("read_file", {"path": "blob.bin", **target})
            blob = back.content[0].resource
            assert base64.b64decode(blob.blob) == bytes(range(256))

            listing = await c.call_tool("list_files", {**target})
            assert "out.txt" in text(listing) and "data/" in text(listing)

    run(scenario())


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_bad_arguments_are_tool_errors_that_say_what_to_fix(gw: Gateway, transport: str, mode: str):
    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            no_code = await c.call_tool("run_python", {**target})
            assert no_code.is_error and "missing field `code`" in text(no_code)
            wrong_type = await c.call_tool("run_python", {"code": 5, **target})
            assert wrong_type.is_error and "invalid type" in text(wrong_type)
            outside = await c.call_tool("read_file", {"path": "../../etc/passwd", **target})
            assert outside.is_error and "'..'" in text(outside)
            absolute = await c.call_tool("write_file", {"path": "/etc/x", "content": "x", **target})
            assert absolute.is_error and "relative" in text(absolute)
            big = await c.call_tool("write_file", {"path": "big.txt", "content": "x" * (10 * 1024 * 1024 + 1), **target})
            assert big.is_error and "10 MiB" in text(big)
            negative = await c.call_tool("read_file", {"path": "x", "offset": -1, **target})
            assert negative.is_error and "invalid value" in text(negative), text(negative)
            nothing = await c.call_tool("read_file", {"path": "x", "length": 0, **target})
            assert nothing.is_error and "length 0" in text(nothing), text(nothing)
            unknown = await c.call_tool("run_python", {"code": "1", "kernel_id": "nope"})
            assert unknown.is_error and "start_kernel" in text(unknown)
            # This gateway serves no packages: the refusal says how an operator changes that.
            packages = await c.call_tool("install_packages", {"packages": ["seaborn"], **target})
            assert packages.is_error and "--packages" in text(packages), text(packages)

    run(scenario())


def test_without_a_session_there_is_no_default_kernel(gw: Gateway):
    async def scenario():
        async with client(gw, "auto") as c:
            result = await c.call_tool("run_python", {"code": "1"})
            assert result.is_error and "start_kernel" in text(result)

    run(scenario())


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_two_sessions_do_not_see_each_others_variables(gw: Gateway, transport: str, mode: str):
    async def scenario():
        async with connected(gw, mode, transport=transport) as (a, ta), connected(gw, mode, transport=transport) as (b, tb):
            await a.call_tool("run_python", {"code": "secret = 'a'", **ta})
            seen = await b.call_tool("run_python", {"code": "secret", **tb})
            assert seen.is_error and "NameError" in text(seen)

    run(scenario())


def test_ending_the_session_removes_its_container(gw: Gateway):
    async def scenario():
        async with client(gw, "legacy") as c:
            result = await c.call_tool("run_python", {"code": "import os; os.environ.get('HOSTNAME', '')"})
            assert not result.is_error, text(result)
            mine = {k["id"] for k in gw.kernels()} & containers(gw)
            return mine

    before = containers(gw)
    during = run(scenario())
    assert during, "the session's kernel ran in a container"
    wait_until("the session's container to go", lambda: not (containers(gw) & (during - before)), timeout=30)


def test_stdio_eof_removes_the_process_kernel(gw: Gateway):
    async def scenario():
        async with stdio_client("legacy") as c:
            result = await c.call_tool("run_python", {"code": "1 + 1"})
            assert text(result) == "2"
            return stdio_containers()

    during = run(scenario())
    assert during, "the stdio session's kernel ran in a container"
    wait_until("the stdio process's containers to go", lambda: not (stdio_containers() & during), timeout=30)


def test_stdio_processes_take_runtime_directories_of_their_own(gw: Gateway):
    def listed() -> set[tuple[str, str]]:
        out = subprocess.run(
            ["docker", "ps", "--filter", "label=org.kernelgate.kernel_id",
             "--format", '{{.Label "org.kernelgate.runtime_dir"}} {{.Label "org.kernelgate.kernel_id"}}'],
            capture_output=True, text=True, check=True).stdout
        return {tuple(line.split()) for line in out.splitlines() if line.startswith(str(STDIO_BASE) + "/")}

    before = listed()

    async def scenario():
        async with stdio_client() as a, stdio_client() as b:
            await a.call_tool("run_python", {"code": "1"})
            await b.call_tool("run_python", {"code": "1"})
            return {d for d, _ in listed() - before}

    dirs = run(scenario())
    assert len(dirs) == 2, dirs
    # Each held a lock while it ran, given back at exit.
    wait_until("the locks to be given back", lambda: not list(STDIO_BASE.glob("*/kernelgate.lock")), timeout=30)


def test_stdio_with_url_deletes_its_kernels_on_the_gateway_at_eof(gw: Gateway):
    async def scenario():
        async with stdio_client("legacy", gateway=gw, token=ALICE) as c:
            assert text(await c.call_tool("run_python", {"code": "1 + 1"})) == "2"
            handle = (await c.call_tool("start_kernel", {})).structured_content["kernel_id"]
            mine = {k["id"] for k in gw.kernels()}
            assert handle in mine
            return mine

    import requests

    def alices() -> set[str]:
        r = requests.get(gw.url + "/api/kernels", headers={"Authorization": f"token {ALICE}"}, timeout=30)
        return {k["id"] for k in r.json()}

    before = alices()
    run(scenario())
    wait_until("the stdio process's kernels to be deleted on the gateway", lambda: alices() <= before, timeout=30)


def test_stdio_with_a_wrong_token_fails_to_start(gw: Gateway):
    async def scenario():
        async with stdio_client("legacy", gateway=gw, token="wrong") as c:
            await c.list_tools()

    with pytest.raises(BaseException):
        run(scenario())


def test_stdio_with_url_reads_the_token_from_a_file(gw: Gateway, tmp_path: Path):
    """The token stays out of the process list: `--token-file`, its trailing newline
    ignored, as a host's config would give it."""
    token_file = tmp_path / "token"
    token_file.write_text(ALICE + "\n")
    token_file.chmod(0o600)

    async def scenario():
        async with stdio_client("legacy", gateway=gw, token_file=token_file) as c:
            return text(await c.call_tool("run_python", {"code": "6 * 7"}))

    assert run(scenario()) == "42"


def test_stdio_with_an_unusable_token_file_says_why_and_exits(gw: Gateway, tmp_path: Path):
    def start(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BINARY), "mcp", "--url", gw.url, *args], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=30,
                              env={"PATH": os.environ["PATH"], "NO_COLOR": "1", "RUST_BACKTRACE": "0"})

    missing = tmp_path / "missing"
    r = start("--token-file", str(missing))
    assert r.returncode != 0 and r.stdout == ""
    assert f"cannot read the token file {missing} (--token-file): No such file or directory" in r.stderr, r.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = start("--token-file", str(empty))
    assert r.returncode != 0
    assert f"cannot read the token file {empty} (--token-file): it is empty; write the gateway's token into it" in r.stderr, r.stderr
    r = start("--token-file", str(empty), "--token", "t")
    assert r.returncode != 0 and "cannot be used with" in r.stderr, r.stderr


def test_restart_clears_state(gw: Gateway):
    async def scenario():
        async with connected(gw, "legacy") as (c, target):
            await c.call_tool("run_python", {"code": "z = 3", **target})
            restarted = await c.call_tool("restart_kernel", {**target})
            assert not restarted.is_error, text(restarted)
            after = await c.call_tool("run_python", {"code": "z", **target})
            assert after.is_error and "NameError" in text(after)

    run(scenario())


@pytest.mark.parametrize("mode", MODES)
def test_wrong_token_is_refused(gw: Gateway, mode: str):
    statuses: list[int] = []

    async def scenario():
        async def record(response):
            statuses.append(response.status_code)

        c = client(gw, mode, token="wrong")
        c.server_http.event_hooks["response"].append(record)
        async with c:
            await c.list_tools()

    with pytest.raises(BaseException) as raised:
        run(scenario())
    assert "Server returned an error response" in repr(raised.value)
    assert statuses and set(statuses) == {403}, statuses


def test_another_key_gets_404_for_sessions_and_kernels(gw: Gateway):
    import requests

    async def scenario():
        async with client(gw, "legacy", token=ALICE) as c:
            await c.call_tool("run_python", {"code": "1"})
            session = c.session  # noqa: F841 - the transport holds the id
            started = await c.call_tool("start_kernel", {})
            kernel = started.structured_content["kernel_id"]
            # Bob cannot use Alice's kernel handle.
            async with client(gw, "auto", token=BOB) as bob:
                stolen = await bob.call_tool("run_python", {"code": "1", "kernel_id": kernel})
                assert stolen.is_error and "no kernel" in text(stolen)
            return kernel

    run(scenario())
    # Bob cannot use Alice's session id either: open one as Alice, replay it as Bob.
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    r = requests.post(gw.url + "/mcp", json=init, headers={**headers, "Authorization": f"token {ALICE}"}, timeout=30)
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    as_bob = requests.post(gw.url + "/mcp", json=ping, timeout=30,
                           headers={**headers, "Authorization": f"token {BOB}", "mcp-session-id": sid,
                                    "mcp-protocol-version": "2025-11-25"})
    assert as_bob.status_code == 404
    as_alice = requests.post(gw.url + "/mcp", json=ping, timeout=30,
                             headers={**headers, "Authorization": f"token {ALICE}", "mcp-session-id": sid,
                                      "mcp-protocol-version": "2025-11-25"})
    assert as_alice.status_code == 200, as_alice.text
    requests.delete(gw.url + "/mcp", timeout=30, headers={"Authorization": f"token {ALICE}", "mcp-session-id": sid,
                                                          "mcp-protocol-version": "2025-11-25"})


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_progress_notifications_carry_output_as_it_arrives(gw: Gateway, transport: str, mode: str):
    code = "import time\nprint('step 1', flush=True)\ntime.sleep(2)\nprint('step 2', flush=True)\n"
    arrivals: list[tuple[float, str]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        arrivals.append((time.monotonic(), message or ""))

    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            result = await c.call_tool("run_python", {"code": code, **target}, progress_callback=on_progress)
            return time.monotonic(), result

    ended, result = run(scenario())
    assert text(result).split() == ["step", "1", "step", "2"]
    messages = [m for _, m in arrivals]
    assert messages == ["step 1\n", "step 2\n"], messages
    # The first line came while the code still slept, not with the result.
    assert ended - arrivals[0][0] > 1.5, (ended, arrivals)


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_cancelling_a_queued_call_only_removes_it_from_the_queue(gw: Gateway, transport: str, mode: str):
    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            results = {}

            async def first():
                results["first"] = await c.call_tool(
                    "run_python", {"code": "import time; time.sleep(4); first_done = True", **target})

            async def second():
                with anyio.move_on_after(1.5):
                    await c.call_tool("run_python", {"code": "second_ran = True", **target})
                results["second_cancelled"] = True

            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                await anyio.sleep(0.5)  # the second call queues behind the first
                tg.start_soon(second)
            after = await c.call_tool("run_python", {"code": "(first_done, 'second_ran' in globals())", **target})
            return results, text(after)

    results, after = run(scenario())
    assert results["second_cancelled"]
    assert not results["first"].is_error, "the running call was not interrupted: " + text(results["first"])
    assert after == "(True, False)", after


def test_policy_and_audit_apply_with_the_session_as_agent_id(gw: Gateway):
    session_ids: set[str] = set()

    async def scenario():
        async def record(response):
            if "mcp-session-id" in response.headers:
                session_ids.add(response.headers["mcp-session-id"])

        c = client(gw, "legacy")
        c.server_http.event_hooks["response"].append(record)
        async with c:
            denied = await c.call_tool("run_python", {"code": "import subprocess"})
            assert denied.is_error and "PolicyViolation" in text(denied), text(denied)
            ok = await c.call_tool("run_python", {"code": "audited = 1"})
            assert not ok.is_error, text(ok)

    run(scenario())
    assert len(session_ids) == 1, session_ids
    (session,) = session_ids
    records = [json.loads(line) for line in (ARTIFACTS / "test_mcp" / "audit.log").read_text().splitlines()]
    mine = [r for r in records if r.get("agent_id") == session]
    decisions = [r for r in mine if r["event"] == "policy_decision"]
    assert decisions and decisions[0]["decision"] == "deny", mine
    assert any(r["event"] == "execution_requested" and "audited = 1" in json.dumps(r) for r in mine), [r["event"] for r in mine]


def test_idle_handles_and_sessions_end_with_their_kernels(tmp_path: Path):
    """With --mcp-idle-timeout 4: a start_kernel kernel left unused is deleted, one in use
    stays; an HTTP session left unused expires and its kernel goes."""
    gw = start_gateway(ARTIFACTS / "test_mcp" / "idle-gateway.log", ["--mcp-idle-timeout", "4"])
    try:
        async def scenario():
            async with client(gw, "auto") as c:
                idle = (await c.call_tool("start_kernel", {})).structured_content["kernel_id"]
                used = (await c.call_tool("start_kernel", {})).structured_content["kernel_id"]
                for _ in range(8):
                    r = await c.call_tool("run_python", {"code": "1", "kernel_id": used})
                    assert not r.is_error, text(r)
                    await anyio.sleep(1)
                ids = {k["id"] for k in gw.kernels()}
                assert idle not in ids and used in ids, (idle, used, ids)
                gone = await c.call_tool("run_python", {"code": "1", "kernel_id": idle})
                assert gone.is_error and "start_kernel" in text(gone)

            # A session whose client goes quiet (no DELETE: the transport is kept open).
            async with client(gw, "legacy") as c:
                await c.call_tool("run_python", {"code": "1"})
                session_kernels = {k["id"] for k in gw.kernels()} - {used}
                await anyio.sleep(12)
                return session_kernels, {k["id"] for k in gw.kernels()}

        session_kernels, after = run(scenario())
        assert session_kernels and not (session_kernels & after), (session_kernels, after)
    finally:
        stop_gateway(gw)


def test_load_eight_sessions_fifty_stateful_steps_each(gw: Gateway):
    """Two agents' worth of load: 8 MCP sessions at once, each running 50 steps that build
    on the previous one; every step answers right and nothing errs."""
    sessions, steps = 8, 50

    async def agent(n: int, times: list[float]):
        async with client(gw, "legacy") as c:
            first = await c.call_tool("run_python", {"code": f"total = 0; me = {n}"})
            assert not first.is_error, text(first)
            for i in range(1, steps + 1):
                t0 = time.monotonic()
                r = await c.call_tool("run_python", {"code": f"total += {i}; (me, total)"})
                times.append(time.monotonic() - t0)
                assert not r.is_error, text(r)
                assert text(r) == f"({n}, {i * (i + 1) // 2})", text(r)

    async def scenario():
        times: list[float] = []
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for n in range(sessions):
                tg.start_soon(agent, n, times)
        return times, time.monotonic() - started

    times, wall = run(scenario())
    assert len(times) == sessions * steps
    times.sort()
    print(f"\n{sessions} sessions x {steps} steps in {wall:.1f} s; step p50 {times[len(times) // 2] * 1000:.0f} ms, "
          f"p99 {times[int(len(times) * 0.99)] * 1000:.0f} ms")


def test_host_and_origin_checks_are_the_gateways(gw: Gateway):
    """rmcp's own Host check (loopback names only) is off: a gateway serving a real name with a
    token answers it, and a foreign web page's Origin is refused as on every other route."""
    import requests

    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    base = {"Accept": "application/json, text/event-stream", "Authorization": f"token {gw.token}"}
    named = requests.post(gw.url + "/mcp", json=init, timeout=30, headers={**base, "Host": "kernels.example.org"})
    assert named.status_code == 200, named.text
    sid = named.headers["mcp-session-id"]
    requests.delete(gw.url + "/mcp", timeout=30, headers={**base, "mcp-session-id": sid, "mcp-protocol-version": "2025-11-25"})
    foreign = requests.post(gw.url + "/mcp", json=init, timeout=30, headers={**base, "Origin": "https://evil.example"})
    assert foreign.status_code == 403
    assert "evil.example" in foreign.json()["message"]


@pytest.fixture(scope="module")
def capped_gw() -> Iterator[Gateway]:
    """A gateway whose output cap (--max-output-mb 1) a test reaches quickly."""
    (ARTIFACTS / "test_mcp").mkdir(parents=True, exist_ok=True)
    gateway = start_gateway(ARTIFACTS / "test_mcp" / "capped-gateway.log", ["--max-output-mb", "1"])
    yield gateway
    stop_gateway(gateway)


@pytest.mark.parametrize("mode", MODES)
def test_timeout_and_output_cap_apply_as_in_the_agent_api(capped_gw: Gateway, mode: str):
    async def scenario():
        async with connected(capped_gw, mode) as (c, target):
            await c.call_tool("run_python", {"code": "kept = 'yes'", **target})
            t0 = time.monotonic()
            slow = await c.call_tool("run_python", {"code": "import time; time.sleep(30)", "timeout": 1, **target})
            assert time.monotonic() - t0 < 15
            assert slow.is_error and "Timed out after 1 s" in text(slow), text(slow)
            assert "KeyboardInterrupt" in text(slow)
            assert text(await c.call_tool("run_python", {"code": "kept", **target})) == "'yes'"

            # 5 MB in a few large stream messages: the first MiB of it reaches the model's
            # side (head and tail within the result budget, the rest counted in the note).
            flood = await c.call_tool("run_python", {"code": "for i in range(5000): print('x' * 999)", **target})
            assert len(text(flood)) < 1_200_000
            assert "output limit" in text(flood), text(flood)[-300:]
            left_out = sum(int(n) for n in re.findall(r"\[\.\.\. (\d+) bytes", text(flood)))
            delivered = text(flood).count("x" * 999) * 1000 + left_out
            assert delivered >= 1_000_000, (delivered, text(flood)[-500:])
            assert text(await c.call_tool("run_python", {"code": "kept", **target})) == "'yes'"

    run(scenario())


def test_a_hostile_session_does_not_affect_another(gw: Gateway):
    import requests

    async def scenario():
        async with connected(gw, "legacy") as (good, _), connected(gw, "legacy") as (bad, _):
            await good.call_tool("run_python", {"code": "mine = 7"})
            # Garbage on the wire, a huge argument, a kernel killed from inside.
            junk = requests.post(gw.url + "/mcp", data=b"{not json", timeout=30, headers={
                "Authorization": f"token {gw.token}", "Content-Type": "application/json",
                "Accept": "application/json, text/event-stream"})
            assert junk.status_code >= 400
            huge = await bad.call_tool("run_python", {"code": "#" + "x" * (3 * 1024 * 1024)})
            assert huge.is_error and "too large" in text(huge), text(huge)  # this gateway's policy
            died = await bad.call_tool("run_python", {"code": "import os; os._exit(1)"})
            assert died.is_error and "KernelDied" in text(died), text(died)
            assert text(await good.call_tool("run_python", {"code": "mine"})) == "7"
            # The bad session goes on on its restarted kernel.
            again = await bad.call_tool("run_python", {"code": "1 + 1"})
            assert text(again).endswith("2"), text(again)

    run(scenario())


def test_stdio_applies_the_policy_and_audits_with_its_session_as_agent_id(gw: Gateway):
    async def scenario():
        async with stdio_client("legacy") as c:
            denied = await c.call_tool("run_python", {"code": "import subprocess"})
            assert denied.is_error and "PolicyViolation" in text(denied), text(denied)
            await c.call_tool("run_python", {"code": "stdio_audited = 1"})

    run(scenario())
    records = [json.loads(line) for line in (ARTIFACTS / "test_mcp" / "stdio-audit.log").read_text().splitlines()]
    ran = [r for r in records if r["event"] == "execution_requested" and "stdio_audited" in json.dumps(r)]
    assert ran and ran[-1]["agent_id"].startswith("mcp-stdio-"), ran
    agent = ran[-1]["agent_id"]
    assert any(r["event"] == "policy_decision" and r["agent_id"] == agent for r in records)


# What a model is sent: every result and progress notification within the default
# --mcp-max-result-kb (256 KiB), text as a terminal shows it, one MIME type per output.

BUDGET = 256 * 1024
# One transport of each kind, for the checks that do not depend on the protocol mode.
TRANSPORTS = [("http", "auto"), ("stdio", "legacy"), ("stdio-url", "auto")]
TRANSPORT_IDS = [t for t, _ in TRANSPORTS]


def wire_size(result) -> int:
    """The result's JSON as the server sent it, near enough (the envelope aside)."""
    return len(result.model_dump_json(by_alias=True, exclude_none=True).encode())


THREE_FIGURES = (
    "import matplotlib.pyplot as plt, numpy as np\n"
    "rng = np.random.default_rng(0)\n"
    "for i in range(3):\n"
    "    plt.figure(figsize=(3, 3))\n"  # random pixels: each PNG about 200 KiB as base64
    "    plt.imshow(rng.random((600, 600)))\n"
    "    plt.show()\n"
    "print('drawn')\n"
)


@pytest.mark.parametrize(("transport", "mode"), WAYS, ids=WAY_IDS)
def test_large_output_and_figures_fit_the_result_budget(gw: Gateway, transport: str, mode: str):
    """A 1.1 MB print and three large figures: before, the client refused the message (over
    its 1 MiB SSE limit) or the host got megabytes. Now head, tail and a note; the figure
    that fits, and a note for the others; progress notifications within the budget too."""
    progress: list[str] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            big = await c.call_tool("run_python", {
                "code": "print('HEAD' + 'a' * 1_100_000 + 'TAIL')", **target}, progress_callback=on_progress)
            figures = await c.call_tool("run_python", {"code": THREE_FIGURES, **target}, progress_callback=on_progress)
            return big, figures

    big, figures = run(scenario())
    assert not big.is_error, text(big)[:300]
    assert wire_size(big) <= BUDGET, wire_size(big)
    out = text(big)
    assert out.startswith("HEADaaaa") and out.endswith("aaaaTAIL\n"), (out[:20], out[-20:])
    note = re.search(r"\[\.\.\. (\d+) bytes \(\d+ lines\) left out here: .*read_file's offset and length", out)
    assert note, out[100_000:100_400]
    assert len(out) + int(note.group(1)) - len(note.group(0)) > 1_100_000
    assert len(out) > BUDGET * 0.9, "the budget is used, not wasted"

    assert not figures.is_error, text(figures)
    assert wire_size(figures) <= BUDGET, wire_size(figures)
    images = [b for b in figures.content if b.type == "image"]
    assert len(images) == 1 and base64.b64decode(images[0].data).startswith(PNG_MAGIC), figures.content
    assert "[2 images left out (image/png" in text(figures), text(figures)
    assert "drawn" in text(figures)

    assert progress, "progress notifications came"
    assert all(len(json.dumps(m)) <= BUDGET for m in progress), [len(m) for m in progress]
    assert any(m.startswith("HEADaaa") and "left out here" in m for m in progress), [m[:40] for m in progress]


@pytest.mark.parametrize(("transport", "mode"), TRANSPORTS, ids=TRANSPORT_IDS)
def test_read_file_reads_a_file_larger_than_the_budget_in_parts(gw: Gateway, transport: str, mode: str):
    lines = 60_000  # 12 bytes each: 720,000 bytes

    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            made = await c.call_tool("run_python", {
                "code": f"with open('big.txt', 'w') as f:\n    f.writelines(f'line {{i:06d}}\\n' for i in range({lines}))",
                **target})
            assert not made.is_error, text(made)
            parts, offset = [], 0
            while True:
                args = {"path": "big.txt", **target} if offset == 0 else {"path": "big.txt", "offset": offset, **target}
                part = await c.call_tool("read_file", args)
                assert not part.is_error, text(part)[-300:]
                assert wire_size(part) <= BUDGET, wire_size(part)
                content, note = part.content[0].text, part.content[1].text
                parts.append(content)
                follow = re.fullmatch(r"\[big\.txt: bytes (\d+)-(\d+) of 720000; (\d+) more bytes follow: "
                                      r"call read_file with offset=(\d+) for the next part\]", note)
                if follow is None:
                    assert note == f"[big.txt: bytes {offset}-719999 of 720000, up to the end of the file]", note
                    break
                first, last, more, offset = map(int, follow.groups())
                assert (last + 1, 720_000 - more) == (offset, offset), note
            middle = await c.call_tool("read_file", {"path": "big.txt", "offset": 12 * 31_415, "length": 24, **target})
            past = await c.call_tool("read_file", {"path": "big.txt", "offset": 720_000, **target})
            return parts, middle, past

    parts, middle, past = run(scenario())
    # Each part as large as the budget allows (a newline takes two bytes as JSON: \n).
    assert len(parts) == 4 and all(len(p) > 230_000 for p in parts[:3]), [len(p) for p in parts]
    assert "".join(parts) == "".join(f"line {i:06d}\n" for i in range(lines))
    assert middle.content[0].text == "line 031415\nline 031416\n"
    assert "call read_file with offset=377004 " in middle.content[1].text, middle.content[1].text
    assert past.is_error and "past the end of big.txt (720000 bytes)" in text(past), text(past)


MODEL_TEXT = r"""
import sys, time
from IPython.display import Markdown, SVG, display
import pandas as pd
for i in range(0, 101, 5):
    print(f'\rtraining {i:3d}%|' + '#' * (i // 10), end='', flush=True)
    if i in (0, 50):
        time.sleep(0.3)  # so the frames come in several stream messages
print()
print('\033[1;32mpassed\033[0m', file=sys.stderr)
display(Markdown('# Report\n*all good*'))
display(SVG('<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"><rect width="4" height="4"/></svg>'))
pd.DataFrame({'a': [1, 2], 'b': [3.5, 4.5]})
"""


@pytest.mark.parametrize(("transport", "mode"), TRANSPORTS, ids=TRANSPORT_IDS)
def test_text_is_what_a_terminal_shows_and_each_output_its_best_type(gw: Gateway, transport: str, mode: str):
    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            shown = await c.call_tool("run_python", {"code": MODEL_TEXT, **target})
            failed = await c.call_tool("run_python", {"code": "def f():\n    return 1/0\nf()", **target})
            return shown, failed

    shown, failed = run(scenario())
    assert not shown.is_error, text(shown)
    assert [b.type for b in shown.content] == ["text"] * 5, shown.content
    stdout, stderr, markdown, svg, frame = (b.text for b in shown.content)
    assert stdout == "training 100%|##########\n", repr(stdout)  # one line, its last frame
    assert stderr == "[stderr]\npassed\n", repr(stderr)  # no colour codes
    assert markdown == "# Report\n*all good*"  # not <IPython.core.display.Markdown object>
    assert svg.startswith("[SVG image, as its XML source]\n<svg"), svg
    assert frame == "   a    b\n0  1  3.5\n1  2  4.5", frame  # text/plain, not HTML with a <style>
    assert failed.is_error
    message = text(failed)
    assert message.startswith("ZeroDivisionError: division by zero\n"), message
    assert "\x1b" not in message and "----> 3 f()" in message, message


@pytest.mark.parametrize(("transport", "mode"), TRANSPORTS, ids=TRANSPORT_IDS)
def test_restart_removes_the_files_and_says_so(gw: Gateway, transport: str, mode: str):
    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            wrote = await c.call_tool("write_file", {"path": "notes.txt", "content": "keep me?", **target})
            assert not wrote.is_error, text(wrote)
            assert "notes.txt" in text(await c.call_tool("list_files", {**target}))
            restarted = await c.call_tool("restart_kernel", {**target})
            listed = await c.call_tool("list_files", {**target})
            tools = (await c.list_tools()).tools
            return restarted, listed, next(t for t in tools if t.name == "restart_kernel").description

    restarted, listed, description = run(scenario())
    assert not restarted.is_error, text(restarted)
    assert "files in its working directory were removed" in text(restarted), text(restarted)
    assert "notes.txt" not in text(listed), text(listed)
    assert "file in the working directory is removed" in description, description
    assert "stay" not in description


@pytest.mark.parametrize(("transport", "mode"), [("http", "auto"), ("stdio-url", "auto")], ids=["http", "stdio-url"])
def test_a_model_forks_a_kernel_and_starts_one_from_a_snapshot(gw: Gateway, transport: str, mode: str):
    """snapshot_kernel, start_kernel with its snapshot and fork_kernel, in this gateway's
    table (HTTP) and through another gateway's HTTP API (stdio with --url): each new
    kernel sees the state, and a change in one stays in it."""
    async def scenario():
        async with connected(gw, mode, transport=transport) as (c, target):
            ran = await c.call_tool("run_python", {"code": "x = 41\nopen('seen.txt', 'w').write('yes')", **target})
            assert not ran.is_error, text(ran)
            name = f"base-{secrets.token_hex(4)}"
            snap = await c.call_tool("snapshot_kernel", {"name": name, **target})
            assert not snap.is_error, text(snap)
            assert snap.structured_content["name"] == name and "snapshot_id" in text(snap)
            started = await c.call_tool("start_kernel", {"snapshot": name})
            assert not started.is_error, text(started)
            restored = started.structured_content["kernel_id"]
            seen = await c.call_tool("run_python", {"code": "print(x + 1, open('seen.txt').read())", "kernel_id": restored})
            assert text(seen).split() == ["42", "yes"], text(seen)
            forked = await c.call_tool("fork_kernel", {"count": 2, **target})
            assert not forked.is_error, text(forked)
            copies = forked.structured_content["kernel_ids"]
            assert len(copies) == 2 and len(set(copies)) == 2, text(forked)
            changed = await c.call_tool("run_python", {"code": "x = 0", "kernel_id": copies[0]})
            assert not changed.is_error, text(changed)
            other = await c.call_tool("run_python", {"code": "x + 1", "kernel_id": copies[1]})
            assert text(other).strip() == "42", text(other)
            missing = await c.call_tool("start_kernel", {"snapshot": "no-such-snapshot"})
            assert missing.is_error and "no snapshot" in text(missing), text(missing)
            too_many = await c.call_tool("fork_kernel", {"count": 21, **target})
            assert too_many.is_error and "1 to 20" in text(too_many), text(too_many)

    run(scenario())

"""E2B's own SDKs (`e2b`, `e2b-code-interpreter`, unmodified, pinned in requirements.txt)
against the gateway's E2B-compatible surface (docs/e2b.md): the SDK is pointed at the
gateway with E2B_API_URL and E2B_SANDBOX_URL, its API key is a Kernelgate key.

One gateway (warm pool of 2) serves the module; each test makes the sandboxes it needs."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

from conftest import ARTIFACTS, Gateway, gvisor_engine, start_gateway, stop_gateway

from e2b import (
    AuthenticationException,
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    SandboxQuery,
    TimeoutException,
)
from e2b_code_interpreter import Sandbox

KEYS = """
[[key]]
name = "alice"
token_sha256 = "{alice}"

[[key]]
name = "bob"
token_sha256 = "{bob}"
"""


def sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture(scope="module")
def gw(tmp_path_factory) -> Iterator[Gateway]:
    artifacts = ARTIFACTS / "test_e2b"
    artifacts.mkdir(parents=True, exist_ok=True)
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS.format(alice=sha256("alice-key"), bob=sha256("bob-key")))
    gw = start_gateway(artifacts / "gateway.log", ["--pool-size", "2", "--keys", str(keys)])
    try:
        yield gw
    finally:
        stop_gateway(gw)


def opts(gw: Gateway, key: str) -> dict:
    """What E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY would say, as the SDK's options."""
    return {"api_url": gw.url, "sandbox_url": gw.url, "api_key": key}


@pytest.fixture
def sbx(gw: Gateway) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(**opts(gw, gw.token))
    yield sandbox
    try:
        sandbox.kill()
    except Exception:
        pass


def test_create_with_metadata_and_envs_then_list_info_and_kill(gw: Gateway):
    o = opts(gw, "alice-key")
    run = os.urandom(4).hex()
    sandbox = Sandbox.create(metadata={"run": run, "who": "a b"}, envs={"GREETING": "hi there"}, **o)
    try:
        out = sandbox.run_code("import os; os.environ['GREETING']")
        assert out.error is None, out.error
        assert out.text == "'hi there'"
        info = sandbox.get_info()
        assert info.sandbox_id == sandbox.sandbox_id
        assert info.metadata == {"run": run, "who": "a b"}
        listed = Sandbox.list(query=SandboxQuery(metadata={"run": run}), **o).next_items()
        assert [s.sandbox_id for s in listed] == [sandbox.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"run": "other"}), **o).next_items() == []
        # The sandbox is the kernel of the same id.
        r = gw.request("GET", f"/api/kernels/{sandbox.sandbox_id}")
        assert r.status_code == 200, r.text
    finally:
        sandbox.kill()
    assert gw.request("GET", f"/api/kernels/{sandbox.sandbox_id}").status_code == 404
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sandbox.sandbox_id, **o)


def test_run_code_is_stateful_and_streams_while_the_cell_runs(sbx: Sandbox):
    assert sbx.run_code("x = 41").error is None
    assert sbx.run_code("x + 1").text == "42"
    seen: list[tuple[float, str]] = []
    started = time.monotonic()
    out = sbx.run_code(
        "import time, sys\nprint('first', flush=True)\ntime.sleep(1.5)\n"
        "print('oops', file=sys.stderr, flush=True)\nprint('last')",
        on_stdout=lambda m: seen.append((time.monotonic() - started, m.line)),
        on_stderr=lambda m: seen.append((time.monotonic() - started, "err:" + m.line)),
    )
    total = time.monotonic() - started
    assert [text for _, text in seen] == ["first\n", "err:oops\n", "last\n"]
    # The first line arrived while the cell was still sleeping.
    assert seen[0][0] < total - 1.0, (seen, total)
    assert out.logs.stdout == ["first\n", "last\n"]
    assert out.execution_count and out.execution_count > 1


def test_errors_charts_and_dataframes(sbx: Sandbox):
    out = sbx.run_code("1/0")
    assert out.error is not None
    assert out.error.name == "ZeroDivisionError"
    assert out.error.value == "division by zero"
    assert "ZeroDivisionError" in out.error.traceback
    out = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
    )
    assert out.error is None, out.error
    pngs = [r.png for r in out.results if r.png]
    assert pngs and pngs[0].startswith("iVBORw0KGgo"), out.results
    out = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert out.error is None, out.error
    main = [r for r in out.results if r.is_main_result][0]
    assert "<table" in main.html and "a" in main.text


def test_a_run_the_sdk_gives_up_on_is_interrupted(sbx: Sandbox):
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(60)\nafter = True", timeout=2)
    # The kernel was interrupted, not left sleeping: the next run comes at once.
    out = sbx.run_code("'after' in globals()")
    assert out.text == "False"
    assert time.monotonic() - started < 30


def test_a_retried_create_gets_the_same_sandbox(gw: Gateway):
    headers = {"X-API-KEY": gw.token, "Idempotency-Key": os.urandom(8).hex()}
    body = {"templateID": "code-interpreter-v1", "timeout": 60}
    first = requests.post(gw.url + "/v2/sandboxes", json=body, headers=headers, timeout=60)
    again = requests.post(gw.url + "/v2/sandboxes", json=body, headers=headers, timeout=60)
    assert first.status_code == again.status_code == 201, (first.text, again.text)
    assert first.json()["sandboxID"] == again.json()["sandboxID"]
    assert first.json()["envdAccessToken"] == again.json()["envdAccessToken"]
    other = requests.post(gw.url + "/v2/sandboxes", json=body, headers={"X-API-KEY": gw.token}, timeout=60)
    assert other.json()["sandboxID"] != first.json()["sandboxID"]
    for sid in {first.json()["sandboxID"], other.json()["sandboxID"]}:
        Sandbox.kill(sid, **opts(gw, gw.token))


def test_refused_languages_and_run_env_vars(sbx: Sandbox):
    with pytest.raises(SandboxException, match="language"):
        sbx.run_code("1", language="r")
    out = sbx.run_code("import os; os.environ.get('ONLY_NOW')", envs={"ONLY_NOW": "yes"})
    assert out.text == "'yes'"
    assert sbx.run_code("import os; os.environ.get('ONLY_NOW')").text is None


def test_contexts_share_files_but_not_variables(sbx: Sandbox):
    ctx = sbx.create_code_context()
    assert ctx.language == "python" and ctx.cwd == "/home/user"
    assert sbx.run_code("secret = 7\nopen('shared.txt', 'w').write('from ctx')", context=ctx).error is None
    out = sbx.run_code("secret", context=ctx)
    assert out.text == "7"
    out = sbx.run_code("secret")
    assert out.error is not None and out.error.name == "NameError"
    assert sbx.run_code("open('shared.txt').read()").text == "'from ctx'"
    ids = [c.id for c in sbx.list_code_contexts()]
    assert ctx.id in ids
    sbx.restart_code_context(ctx)
    assert sbx.run_code("secret", context=ctx).error.name == "NameError"
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]


def test_contexts_across_a_hibernation(gw: Gateway, sbx: Sandbox):
    """A hibernation keeps the default context's variables and the files; another context
    stays listed, its variables are gone, and its first run after the resume says why."""
    ctx = sbx.create_code_context()
    assert sbx.run_code("kept = 6 * 7\nopen('kept.txt', 'w').write('on disk')").error is None
    assert sbx.run_code("lost = 'ctx'", context=ctx).error is None
    assert sbx.run_code("lost", context=ctx).text == "'ctx'"

    r = gw.request("POST", f"/api/kernels/{sbx.sandbox_id}/hibernate")
    assert r.status_code == 200, r.text
    assert r.json()["hibernated"] is True

    # The next run wakes the kernel: the default namespace and the files are back.
    assert sbx.run_code("kept").text == "42"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    # The other context sees the files, starts empty again, and its first run after the
    # resume says so on stderr, naming the context and the hibernation; later runs do not.
    first = sbx.run_code("open('kept.txt').read()", context=ctx)
    assert first.text == "'on disk'"
    said = "".join(first.logs.stderr)
    assert f"code context {ctx.id} starts empty again" in said, first.logs
    assert "hibernated and resumed" in said, said
    out = sbx.run_code("lost", context=ctx)
    assert out.error is not None and out.error.name == "NameError"
    assert out.logs.stderr == [], "said once"
    assert sbx.run_code("lost = 2\nlost", context=ctx).text == "2"
    # A context restarted on purpose is not a lost one: nothing is said.
    sbx.restart_code_context(ctx)
    out = sbx.run_code("'fresh'", context=ctx)
    assert out.text == "'fresh'" and out.logs.stderr == [], out.logs


def test_files_through_the_sdk(sbx: Sandbox):
    sbx.files.write("/home/user/notes/a.txt", "hello")
    assert sbx.files.read("/home/user/notes/a.txt") == "hello"
    blob = os.urandom(300 * 1024)
    sbx.files.write("data.bin", blob)
    assert bytes(sbx.files.read("/home/user/data.bin", format="bytes")) == blob
    sbx.files.write_files([
        {"path": "/home/user/many/one.txt", "data": "1"},
        {"path": "/home/user/many/two.txt", "data": b"2"},
    ])
    names = sorted(e.name for e in sbx.files.list("/home/user/many"))
    assert names == ["one.txt", "two.txt"]
    assert sbx.run_code("open('many/two.txt').read()").text == "'2'"
    info = sbx.files.get_info("/home/user/data.bin")
    assert info.size == len(blob) and info.type.value == "file"
    assert sbx.files.make_dir("/home/user/empty") is True
    assert sbx.files.make_dir("/home/user/empty") is False
    sbx.files.rename("/home/user/notes/a.txt", "/home/user/notes/b.txt")
    assert not sbx.files.exists("/home/user/notes/a.txt")
    assert sbx.files.read("/home/user/notes/b.txt") == "hello"
    sbx.files.remove("/home/user/notes")
    assert not sbx.files.exists("/home/user/notes/b.txt")
    for outside in ["/etc/passwd", "/home/user/../../etc/passwd", "/tmp/x", "/home/username/x"]:
        with pytest.raises(InvalidArgumentException):
            sbx.files.read(outside)
        with pytest.raises(InvalidArgumentException):
            sbx.files.write(outside, "x")
        with pytest.raises(InvalidArgumentException):
            sbx.files.list(outside)


def test_commands_run_with_output_exit_code_cwd_and_envs(sbx: Sandbox):
    sbx.files.make_dir("/home/user/work")
    done = sbx.commands.run(
        "echo out; echo err >&2; pwd; echo \"$GREETING\"; id -u",
        envs={"GREETING": "hello there"},
        cwd="/home/user/work",
    )
    assert done.exit_code == 0
    lines = done.stdout.splitlines()
    assert lines[0] == "out"
    assert lines[1].endswith("/work")
    assert lines[2] == "hello there"
    assert lines[3] != "0", "commands never run as root"
    assert done.stderr == "err\n"
    # A file a command writes is the code's and the files API's.
    sbx.commands.run("echo from-a-command > made.txt")
    assert sbx.files.read("/home/user/made.txt") == "from-a-command\n"
    assert sbx.run_code("open('made.txt').read()").text == "'from-a-command\\n'"
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo nope >&2; exit 3")
    assert failed.value.exit_code == 3
    assert failed.value.stderr == "nope\n"


def test_background_commands_are_listed_killed_and_take_stdin(sbx: Sandbox):
    sleeper = sbx.commands.run("sleep 300", background=True)
    assert sleeper.pid in [p.pid for p in sbx.commands.list()]
    listed = next(p for p in sbx.commands.list() if p.pid == sleeper.pid)
    assert listed.cmd == "/bin/bash" and listed.args[-1] == "sleep 300"
    assert sbx.commands.kill(sleeper.pid) is True
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sleeper.pid in [p.pid for p in sbx.commands.list()]:
        time.sleep(0.2)
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(sleeper.pid) is False, "a process that ended is not found"
    # Input sent to a command, then its end of file.
    cat = sbx.commands.run("cat; echo done", background=True, stdin=True)
    cat.send_stdin("line one\n")
    sbx.commands.send_stdin(cat.pid, "line two\n")
    sbx.commands.close_stdin(cat.pid)
    result = cat.wait()
    assert result.stdout == "line one\nline two\ndone\n"
    # A client that reconnects sees what comes after.
    ticker = sbx.commands.run("sleep 1; echo tick; sleep 1; echo tock", background=True)
    ticker.disconnect()
    again = sbx.commands.connect(ticker.pid)
    assert "tock" in again.wait().stdout
    # A foreground command past its timeout is killed.
    late = "sleep 30; echo late > late.txt"
    with pytest.raises(TimeoutException):
        sbx.commands.run(late, timeout=1)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(p.args[-1] == late for p in sbx.commands.list()):
        time.sleep(0.2)
    assert all(p.args[-1] != late for p in sbx.commands.list()), "killed at its timeout"


def test_a_terminal_runs_an_interactive_shell(sbx: Sandbox):
    from e2b import PtySize

    seen = bytearray()
    terminal = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(terminal.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(terminal.pid, b"stty size; echo $((6*7)); exit\n")
    result = terminal.wait(on_pty=lambda data: seen.extend(data))
    text = seen.decode(errors="replace")
    assert "40 120" in text, text
    assert "42" in text, text
    assert result.exit_code == 0


def test_commands_see_no_network_and_root_is_refused(sbx: Sandbox):
    interfaces = sbx.commands.run("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").stdout.split()
    assert interfaces == ["lo"]
    routes = sbx.commands.run("tail -n +2 /proc/net/route").stdout.strip()
    assert routes == "", "no route out of the sandbox"
    with pytest.raises(SandboxException, match='"root" is refused'):
        sbx.commands.run("id", user="root")


def test_commands_are_audited_and_meet_the_policys_shell_rules(gw: Gateway, sbx: Sandbox, tmp_path):
    sbx.commands.run("echo audited-command")
    audit = (ARTIFACTS / "test_e2b" / "gateway-audit.log").read_text().splitlines()
    records = [json.loads(line) for line in audit if sbx.sandbox_id in line]
    started = [r for r in records if r["event"] == "command_started" and r["command"] == "echo audited-command"]
    assert len(started) == 1
    finished = [r for r in records if r["event"] == "command_finished" and r["pid"] == started[0]["pid"]]
    assert finished and finished[0]["exit_code"] == 0 and finished[0]["output"] == "audited-command\n"
    policy = tmp_path / "policy.toml"
    policy.write_text('[[rule]]\naction = "deny"\nreason = "no shell commands here"\nshell = true\n')
    guarded = start_gateway(ARTIFACTS / "test_e2b" / "policy-gateway.log", ["--policy", str(policy)])
    try:
        sandbox = Sandbox.create(**opts(guarded, guarded.token))
        with pytest.raises(SandboxException, match="no shell commands here"):
            sandbox.commands.run("ls")
        assert sandbox.run_code("1 + 1").text == "2", "the sandbox itself runs on"
        sandbox.kill()
    finally:
        stop_gateway(guarded)


def test_options_without_a_network_are_refused_by_name(gw: Gateway):
    with pytest.raises(SandboxException, match="no network by design"):
        Sandbox.create(allow_internet_access=True, **opts(gw, gw.token))


def test_set_timeout_and_expiry(gw: Gateway):
    sandbox = Sandbox.create(timeout=120, **opts(gw, gw.token))
    before = sandbox.get_info().end_at
    sandbox.set_timeout(3)
    assert sandbox.get_info().end_at < before
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sandbox.is_running():
        time.sleep(0.5)
    assert not sandbox.is_running()
    assert gw.request("GET", f"/api/kernels/{sandbox.sandbox_id}").status_code == 404


def test_keys_tokens_and_other_keys_sandboxes(gw: Gateway):
    with pytest.raises(AuthenticationException):
        Sandbox.create(**opts(gw, "wrong-key"))
    alice = Sandbox.create(**opts(gw, "alice-key"))
    try:
        with pytest.raises(NotFoundException):
            Sandbox.get_info(alice.sandbox_id, **opts(gw, "bob-key"))
        assert Sandbox.kill(alice.sandbox_id, **opts(gw, "bob-key")) is False
        assert alice.sandbox_id not in [s.sandbox_id for s in Sandbox.list(**opts(gw, "bob-key")).next_items()]
        # The sandbox plane wants the sandbox's own token.
        headers = {"E2b-Sandbox-Id": alice.sandbox_id, "E2b-Sandbox-Port": "49999",
                   "X-Access-Token": "0" * 64}
        r = requests.post(gw.url + "/execute", json={"code": "1"}, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        del headers["X-Access-Token"]
        r = requests.post(gw.url + "/execute", json={"code": "1"}, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        # Code contexts too: the SDK sends them E2B-Traffic-Access-Token, checked the same way.
        for token in ({}, {"E2B-Traffic-Access-Token": "0" * 64}):
            r = requests.get(gw.url + "/contexts", headers={**headers, **token}, timeout=30)
            assert r.status_code == 401, r.text
            r = requests.post(gw.url + "/contexts", json={"language": "python"},
                              headers={**headers, **token}, timeout=30)
            assert r.status_code == 401, r.text
        assert alice.traffic_access_token
        r = requests.get(gw.url + "/contexts", timeout=30,
                         headers={**headers, "E2B-Traffic-Access-Token": alice.traffic_access_token})
        assert r.status_code == 200, r.text
        assert alice.run_code("1+1").text == "2"
        # Wrong keys are throttled and audited as on every other route; a valid key is not.
        statuses = [
            requests.get(gw.url + "/v2/sandboxes", headers={"X-API-KEY": f"guess-{i}"}, timeout=30)
            for i in range(12)
        ]
        # (The wrong sandbox tokens above count against this address too.)
        assert statuses[0].status_code == 401
        assert statuses[-1].status_code == 429 and "Retry-After" in statuses[-1].headers
        assert statuses[-1].json()["code"] == 429
        # A wrong sandbox token is a refused credential like a wrong key: throttled now.
        r = requests.post(gw.url + "/execute", json={"code": "1"}, timeout=30,
                          headers={**headers, "X-Access-Token": "1" * 64})
        assert r.status_code == 429 and "Retry-After" in r.headers, r.text
        assert alice.is_running()
        audit = gw.log_path.with_name(gw.log_path.stem + "-audit.log").read_text()
        assert "/v2/sandboxes" in audit
        refused_tokens = [line for line in audit.splitlines()
                          if '"auth_refused"' in line and alice.sandbox_id in line]
        assert len(refused_tokens) >= 2, audit[-2000:]
    finally:
        alice.kill()


def test_the_host_form_of_the_sandbox_url(gw: Gateway, sbx: Sandbox):
    port = gw.url.rsplit(":", 1)[1]
    token = sbx._envd_access_token
    host = f"49999-{sbx.sandbox_id}.sandbox.localhost:{port}"
    r = requests.post(gw.url + "/execute", json={"code": "6*7"},
                      headers={"Host": host, "X-Access-Token": token}, timeout=30)
    assert r.status_code == 200, r.text
    lines = [l for l in r.text.splitlines() if l]
    assert '"text":"42"' in lines[0].replace(" ", "")
    assert '"number_of_executions"' in lines[-1]
    r = requests.get(gw.url + "/health",
                     headers={"Host": f"49983-{sbx.sandbox_id}.sandbox.localhost", "X-Access-Token": token}, timeout=30)
    assert r.status_code == 204


def test_snapshots_and_forks_through_the_sdk(gw: Gateway):
    """create_snapshot, list_snapshots, a create from a snapshot, fork and delete_snapshot,
    onto the gateway's own snapshots (docs/snapshots.md)."""
    o, bob = opts(gw, "alice-key"), opts(gw, "bob-key")
    name = f"cleaned-{os.urandom(4).hex()}"
    source = Sandbox.create(metadata={"stage": "source"}, **o)
    made = [source]
    try:
        assert source.run_code("import numpy as np\na = np.arange(10)").error is None
        source.files.write("notes.txt", "kept")
        snap = source.create_snapshot(name)
        assert snap.names == [name]
        files_only = source.create_snapshot(mode="filesystem")
        assert files_only.names == []

        # Listed for its sandbox, newest first, in pages; by name or id; not for another key.
        pager = Sandbox.list_snapshots(sandbox_id=source.sandbox_id, limit=1, **o)
        pages = [pager.next_items()]
        assert pager.has_next
        pages.append(pager.next_items())
        assert not pager.has_next
        assert [[s.snapshot_id for s in p] for p in pages] == [
            [files_only.snapshot_id], [snap.snapshot_id]]
        for by in (name, snap.snapshot_id):
            found = Sandbox.list_snapshots(name=by, **o).next_items()
            assert [s.snapshot_id for s in found] == [snap.snapshot_id]
        assert snap.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots(**bob).next_items()]
        assert Sandbox.delete_snapshot(snap.snapshot_id, **bob) is False

        # A create from it (its id as the template): the variables and the file.
        restored = Sandbox.create(template=snap.snapshot_id, **o)
        made.append(restored)
        assert restored.sandbox_id != source.sandbox_id
        assert restored.run_code("int(a.sum())").text == "45"
        assert restored.files.read("notes.txt") == "kept"
        # A files-only one: the file, no variables.
        bare = Sandbox.create(template=files_only.snapshot_id, **o)
        made.append(bare)
        assert bare.files.read("notes.txt") == "kept"
        assert bare.run_code("a").error.name == "NameError"

        # Two forks, each a running sandbox apart from the other and from the source.
        forks = source.fork(count=2, timeout=120)
        assert all(isinstance(f, Sandbox) for f in forks), forks
        made.extend(forks)
        assert len({f.sandbox_id for f in forks} | {source.sandbox_id}) == 3
        assert forks[0].run_code("a[0] = 100\nint(a.sum())").text == "145"
        assert forks[1].run_code("int(a.sum())").text == "45"
        assert source.run_code("int(a.sum())").text == "45"
        forks[1].files.write("notes.txt", "changed")
        assert source.files.read("notes.txt") == "kept"
        assert forks[0].get_info().metadata == {"stage": "source"}

        # Deleted: gone from the list, and no longer a template.
        assert Sandbox.delete_snapshot(snap.snapshot_id, **o) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id, **o) is False
        assert snap.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots(**o).next_items()]
        with pytest.raises(SandboxException, match="no snapshot of this key"):
            Sandbox.create(template=snap.snapshot_id, **o)
        assert Sandbox.delete_snapshot(files_only.snapshot_id, **o) is True
    finally:
        for sandbox in made:
            try:
                sandbox.kill()
            except Exception:
                pass


def test_pause_and_connect_keep_the_state(gw: Gateway):
    """pause hibernates the sandbox's kernel, connect resumes it (docs/e2b.md);
    on_resume="reboot" keeps the files. What only one engine keeps (a generator): below."""
    from e2b import SandboxState

    o = opts(gw, "alice-key")
    sandbox = Sandbox.create(timeout=120, **o)
    sid = sandbox.sandbox_id
    try:
        assert sandbox.run_code("x = 41").error is None
        sandbox.files.write("kept.txt", "yes")
        assert sandbox.pause() is True
        assert sandbox.pause() is False, "paused already"
        assert Sandbox.get_info(sid, **o).state == SandboxState.PAUSED
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **o).next_items()
        assert sid in [s.sandbox_id for s in paused]
        running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING]), **o).next_items()
        assert sid not in [s.sandbox_id for s in running]

        resumed = Sandbox.connect(sid, **o)
        assert resumed.run_code("x + 1").text == "42"
        assert Sandbox.get_info(sid, **o).state == SandboxState.RUNNING

        # on_resume="reboot": a fresh kernel with the files, under every engine (the gVisor
        # engine keeps the home's files beside its whole-kernel checkpoint for this).
        assert resumed.pause() is True
        rebooted = Sandbox.connect(sid, on_resume="reboot", **o)
        assert rebooted.run_code("x").error.name == "NameError"
        assert rebooted.files.read("kept.txt") == "yes"
    finally:
        Sandbox.kill(sid, **o)


def test_a_generator_across_pause_and_connect(gw: Gateway):
    """A generator halfway through: the gVisor engine's pause keeps the whole kernel, so a
    connect resumes it where it stopped; Docker's saves variables, so its pause is refused
    naming the generator and the sandbox runs on (docs/e2b.md, docs/hibernation.md)."""
    from e2b import SandboxState

    o = opts(gw, gw.token)
    # The engine this run meant is the one the gateway runs kernels on.
    runtime = gw.request("GET", "/api").json()["kernelgate"]["runtime"]
    assert (runtime == "gvisor") == gvisor_engine(), runtime
    sbx = Sandbox.create(**o)
    sid = sbx.sandbox_id
    try:
        assert sbx.run_code("g = (i * i for i in range(10)); next(g); next(g)").text == "1"
        if gvisor_engine():
            assert sbx.pause() is True
            assert Sandbox.get_info(sid, **o).state == SandboxState.PAUSED
            resumed = Sandbox.connect(sid, **o)
            assert Sandbox.get_info(sid, **o).state == SandboxState.RUNNING
            assert resumed.run_code("next(g)").text == "4"
            assert resumed.run_code("list(g)").text == "[9, 16, 25, 36, 49, 64, 81]"
        else:
            with pytest.raises(SandboxException, match=r"runs on, not paused: .*g \(generator\)"):
                sbx.pause()
            assert Sandbox.get_info(sid, **o).state == SandboxState.RUNNING
            assert sbx.run_code("next(g)").text == "4"
    finally:
        Sandbox.kill(sid, **o)


def test_a_timeout_that_pauses_keeps_the_sandbox(gw: Gateway):
    """lifecycle on_timeout=pause: the timeout hibernates the sandbox instead of ending it,
    a connect resumes it with its variables; what cannot be honoured is refused by name."""
    from e2b import SandboxState

    o = opts(gw, "alice-key")
    with pytest.raises(SandboxException, match="auto_resume=False is refused"):
        Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": False}, **o)
    with pytest.raises(SandboxException, match="mode=filesystem is refused"):
        Sandbox.create(lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}}, **o)
    sandbox = Sandbox.create(timeout=60, lifecycle={"on_timeout": "pause", "auto_resume": True}, **o)
    sid = sandbox.sandbox_id
    try:
        assert sandbox.run_code("x = 41").error is None
        sandbox.set_timeout(2)
        deadline = time.monotonic() + 60
        while Sandbox.get_info(sid, **o).state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "not paused a minute after its timeout"
            time.sleep(0.5)
        # Kept while paused, past its end.
        time.sleep(3)
        assert Sandbox.get_info(sid, **o).state == SandboxState.PAUSED
        resumed = Sandbox.connect(sid, timeout=60, **o)
        assert resumed.run_code("x + 1").text == "42"
        assert Sandbox.get_info(sid, **o).state == SandboxState.RUNNING
    finally:
        Sandbox.kill(sid, **o)


def test_watch_sees_a_file_written_by_code(sbx: Sandbox):
    from e2b import FilesystemEventType

    sbx.files.write("/home/user/before.txt", "there already")
    h = sbx.files.watch_dir("/home/user")
    try:
        sbx.run_code("open('watched.txt','w').write('x')")
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.name == "watched.txt" for e in seen):
            seen += h.get_new_events()
            time.sleep(0.2)
        kinds = {e.type for e in seen if e.name == "watched.txt"}
        assert kinds & {FilesystemEventType.CREATE, FilesystemEventType.WRITE}, seen
        sbx.run_code("import os; os.remove('watched.txt')")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.type == FilesystemEventType.REMOVE for e in seen):
            seen += h.get_new_events()
            time.sleep(0.2)
        assert ("watched.txt", FilesystemEventType.REMOVE) in {(e.name, e.type) for e in seen}, seen
        assert not any(e.name == "before.txt" for e in seen), "what was there is no event"
    finally:
        h.stop()


def test_watch_dir_streams_events_to_the_async_sdk(gw: Gateway):
    import asyncio
    import concurrent.futures

    from e2b import FilesystemEventType
    from e2b_code_interpreter import AsyncSandbox

    async def scenario():
        sbx = await AsyncSandbox.create(**opts(gw, gw.token))
        try:
            await sbx.files.make_dir("/home/user/sub")
            events, got = [], asyncio.Event()

            def on_event(e):
                events.append(e)
                if e.name == "sub/streamed.txt":
                    got.set()

            h = await sbx.files.watch_dir("/home/user", on_event=on_event, recursive=True, include_entry=True)
            await sbx.run_code("open('sub/streamed.txt','w').write('xyz')")
            await asyncio.wait_for(got.wait(), 10)
            await h.stop()
            created = [e for e in events if e.name == "sub/streamed.txt" and e.type == FilesystemEventType.CREATE]
            assert created and created[0].entry.path == "/home/user/sub/streamed.txt", events

            # The watch's `timeout` ends it with a timeout, told to on_exit.
            exits = []
            await sbx.files.watch_dir("/home/user", on_event=lambda e: None, on_exit=exits.append, timeout=2)
            for _ in range(50):
                if exits:
                    break
                await asyncio.sleep(0.2)
            assert exits and isinstance(exits[0], TimeoutException), exits
        finally:
            await sbx.kill()

    # A loop of its own, in a thread of its own (see test_mcp.py's `run`).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, scenario()).result()


def test_watching_outside_the_home_or_no_directory_is_refused(sbx: Sandbox):
    from e2b import FileNotFoundException

    with pytest.raises(InvalidArgumentException):
        sbx.files.watch_dir("/etc")
    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir("/home/user/missing")
    sbx.files.write("/home/user/plain.txt", "x")
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        sbx.files.watch_dir("/home/user/plain.txt")

"""jupyter_server's gateway client (as JupyterLab uses it) against a Kernelgate cluster:
`jupyter server --gateway-url` points at one node, and every kernel it starts lives on the
other; E2B's SDK reaches a sandbox through the node that does not run it. Two nodes and a real etcd (Debian's etcd-server) on loopback; the Rust cluster suite
covers three nodes in network namespaces and the failure cases.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

from conftest import free_port, start_gateway, stop_gateway, stop_process, wait_until
from test_jupyter_server_gateway import Channels


ALICE = "alice-cluster-key"
KEYS = f"""
[[key]]
name = "alice"
token_sha256 = "{hashlib.sha256(ALICE.encode()).hexdigest()}"
"""


@pytest.fixture
def etcd(tmp_path: Path):
    """One etcd member on free loopback ports, its data in a temporary directory."""
    if not shutil.which("etcd"):
        pytest.fail("etcd is missing: `make test-tools` installs Debian's etcd-server")
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    data = Path(tempfile.mkdtemp(prefix="kg-etcd-", dir=tmp_path))
    log = open(data / "etcd.log", "ab")
    proc = subprocess.Popen(
        ["etcd", "--name", "kg-py", "--data-dir", str(data / "data"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"kg-py=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=log,
    )
    log.close()
    wait_until("etcd to answer", lambda: requests.get(f"{url}/health", timeout=1).ok, timeout=20)
    yield url
    stop_process(proc)


@pytest.fixture
def two_nodes(etcd: str, artifacts: Path, tmp_path: Path):
    """Node "entry" (room for one kernel) and node "owner" (room for two): a create through
    the entry goes to the owner, which has more free room."""
    secret = tmp_path / "cluster.secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    # Every node loads the same keys file: a key works through any node.
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    nodes = []
    try:
        for name, room in [("owner", "2"), ("entry", "1")]:
            nodes.append(start_gateway(
                artifacts / f"node-{name}.log",
                ["--etcd", etcd, "--node-id", name, "--advertise", "http://127.0.0.1:{port}",
                 "--cluster-secret-file", str(secret), "--lease-ttl", "3", "--max-kernels", room,
                 "--keys", str(keys)],
            ))
        owner, entry = nodes

        def both_registered():
            for node in nodes:
                cluster = node.request("GET", "/api").json()["kernelgate"]["cluster"]
                if len(cluster["nodes"]) != 2:
                    return False
            return True

        wait_until("both nodes to see each other", both_registered, timeout=20)
        yield entry, owner
    finally:
        for node in reversed(nodes):
            stop_gateway(node)


def created_on(node, kernel_id: str) -> bool:
    """Whether `node`'s audit trail says it created the kernel."""
    audit = node.log_path.with_name(node.log_path.stem + "-audit.log")
    return any(
        r.get("event") == "kernel_created" and r.get("kernel") == kernel_id
        for r in map(json.loads, audit.read_text().splitlines())
    )


def test_a_notebook_through_a_node_that_does_not_own_its_kernel(two_nodes, jupyter_factory):
    entry, owner = two_nodes
    server = jupyter_factory("server", entry)

    # Start through the entry node: the kernel lives on the other node.
    r = server.request("POST", "/api/kernels", json={"name": "python3"})
    assert r.status_code == 201, r.text
    kid = r.json()["id"]
    assert created_on(owner, kid) and not created_on(entry, kid)
    r = server.request("GET", "/api/kernels")
    assert [k["id"] for k in r.json()] == [kid], r.text
    assert [k["id"] for k in owner.kernels()] == [kid]

    # The notebook's WebSocket (jupyter_server to the entry node, spliced to the owner).
    ch = Channels(f"{server.ws_url}/api/kernels/{kid}/channels", server.token)
    try:
        first = ch.execute("x = 41")
        assert first.reply["status"] == "ok", first.reply
        out = ch.execute("print('hello'); x + 1")
        assert out.reply["status"] == "ok", out.reply
        assert (out.stdout, out.result) == ("hello\n", "42")
        assert out.reply["execution_count"] == first.reply["execution_count"] + 1

        # Interrupt a long sleep through jupyter_server's REST API.
        started = time.monotonic()
        msg_id = ch.execute_start("import time; time.sleep(60)")
        ch.wait_for(
            "the sleep to start",
            lambda m: m["msg_type"] == "execute_input" and m["parent_header"].get("msg_id") == msg_id,
        )
        r = server.request("POST", f"/api/kernels/{kid}/interrupt", json={})
        assert r.status_code == 204, r.text
        out = ch.collect(msg_id, timeout=30)
        assert out.error["ename"] == "KeyboardInterrupt", out.reply
        assert time.monotonic() - started < 30
        assert ch.execute("x").result == "41", "state kept across the interrupt"
    finally:
        ch.close()

    # Restart (state gone, same id and owner), then shut down through the entry node.
    r = server.request("POST", f"/api/kernels/{kid}/restart", json={})
    assert r.status_code == 200, r.text
    ch = Channels(f"{server.ws_url}/api/kernels/{kid}/channels", server.token)
    try:
        out = ch.execute("x")
        assert out.error["ename"] == "NameError", out.reply
    finally:
        ch.close()
    r = server.request("DELETE", f"/api/kernels/{kid}")
    assert r.status_code == 204, r.text
    wait_until("the owner to drop the kernel", lambda: owner.kernels() == [], timeout=10)
    assert entry.request("GET", f"/api/kernels/{kid}").status_code == 404


def test_an_e2b_sandbox_through_a_node_that_does_not_run_it(two_nodes):
    from e2b import CommandExitException
    from e2b_code_interpreter import Sandbox

    entry, owner = two_nodes
    # Everything through the entry node: the create is placed on the node with the most
    # room (the other one), where the sandbox then lives; every call is forwarded there.
    through = {"api_url": entry.url, "sandbox_url": entry.url, "api_key": ALICE}
    made = Sandbox.create(timeout=120, **through)
    assert created_on(owner, made.sandbox_id) and not created_on(entry, made.sandbox_id)
    # A create retried with its idempotency key gets the same sandbox, wherever it went.
    first = Sandbox.create(idempotency_key="cluster-retry-1", **through)
    again = Sandbox.create(idempotency_key="cluster-retry-1", **through)
    assert again.sandbox_id == first.sandbox_id
    first.kill()
    sbx = Sandbox.connect(made.sandbox_id, **through)
    assert sbx.get_info().sandbox_id == made.sandbox_id
    assert sbx.run_code("x = 6 * 7").error is None
    assert sbx.run_code("x").text == "42", "state through the other node"
    sbx.files.write("/home/user/through.txt", "via the entry node")
    assert sbx.files.read("/home/user/through.txt") == "via the entry node"
    assert "through.txt" in [e.name for e in sbx.files.list("/home/user")]
    done = sbx.commands.run("cat through.txt; echo; echo err >&2")
    assert (done.stdout, done.stderr, done.exit_code) == ("via the entry node\n", "err\n", 0)
    cat = sbx.commands.run("cat", background=True, stdin=True)
    cat.send_stdin("piped\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "piped\n"
    with pytest.raises(CommandExitException):
        sbx.commands.run("exit 4")
    # The sandbox plane's token is checked on the node that runs it.
    r = requests.get(f"{entry.url}/health", headers={"E2b-Sandbox-Id": made.sandbox_id,
                                                     "E2b-Sandbox-Port": "49983",
                                                     "X-Access-Token": "wrong"}, timeout=10)
    assert r.status_code == 401, r.text
    sbx.set_timeout(60)
    sbx.kill()
    wait_until("the owner to drop the sandbox", lambda: owner.kernels() == [], timeout=15)
    assert not created_on(entry, made.sandbox_id)

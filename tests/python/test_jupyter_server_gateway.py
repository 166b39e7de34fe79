"""jupyter_server's own gateway client against kernelgate: `jupyter server --gateway-url=...`
serves kernel specs and kernels from the gateway through its GatewayKernelSpecManager,
GatewayMappingKernelManager and gateway WebSocket connection. This test is a client of that
local server only (its REST API and its /api/kernels/{id}/channels WebSocket), and checks
on the gateway that what it asked for really happened there.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import websocket

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class Reply:
    """Everything a kernel sent for one execute_request."""

    reply: dict
    iopub: list[dict] = field(default_factory=list)

    def of_type(self, msg_type: str) -> list[dict]:
        return [m for m in self.iopub if m["msg_type"] == msg_type]

    @property
    def stdout(self) -> str:
        return "".join(m["content"]["text"] for m in self.of_type("stream") if m["content"]["name"] == "stdout")

    @property
    def result(self) -> str | None:
        results = self.of_type("execute_result")
        return results[-1]["content"]["data"]["text/plain"] if results else None

    @property
    def error(self) -> dict | None:
        errors = self.of_type("error")
        return errors[-1]["content"] if errors else None


class Channels:
    """A Jupyter client over jupyter_server's channels WebSocket (the JSON protocol)."""

    def __init__(self, url: str, token: str):
        self.session = uuid.uuid4().hex
        self.ws = websocket.create_connection(
            f"{url}?session_id={self.session}",
            header=[f"Authorization: token {token}"],
            timeout=120,
        )
        self.seen: list[dict] = []  # every message received, in order

    def send(self, channel: str, msg_type: str, content: dict) -> str:
        msg_id = uuid.uuid4().hex
        self.ws.send(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "msg_type": msg_type,
                        "session": self.session,
                        "username": "test",
                        "version": "5.3",
                        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    },
                    "parent_header": {},
                    "metadata": {},
                    "content": content,
                    "buffers": [],
                    "channel": channel,
                }
            )
        )
        return msg_id

    def recv(self, timeout: float) -> dict:
        self.ws.settimeout(timeout)
        msg = json.loads(self.ws.recv())
        self.seen.append(msg)
        return msg

    def wait_for(self, what: str, match, timeout: float = 90) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no {what} within {timeout} s"
            msg = self.recv(left)
            if match(msg):
                return msg

    def execute_start(self, code: str) -> str:
        return self.send("shell", "execute_request", {"code": code, "silent": False, "store_history": True,
                                                      "user_expressions": {}, "allow_stdin": False,
                                                      "stop_on_error": True})

    def collect(self, msg_id: str, timeout: float = 90) -> Reply:
        """Reads until the execute_reply and the IOPub `idle` of `msg_id` both arrived."""
        reply, iopub, idle = None, [], False
        deadline = time.monotonic() + timeout
        while reply is None or not idle:
            left = deadline - time.monotonic()
            assert left > 0, f"execution {msg_id} unfinished after {timeout} s: reply={reply} iopub={iopub}"
            msg = self.recv(left)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["channel"] == "shell" and msg["msg_type"] == "execute_reply":
                reply = msg["content"]
            elif msg["channel"] == "iopub":
                iopub.append(msg)
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
        return Reply(reply, iopub)

    def execute(self, code: str, timeout: float = 90) -> Reply:
        return self.collect(self.execute_start(code), timeout)

    def close(self):
        self.ws.close()


def test_jupyter_server_gateway_client(gateway, jupyter_factory):
    server = jupyter_factory("server", gateway)

    # Kernel specs come from the gateway; resource URLs point at jupyter_server, which
    # fetches the files from the gateway.
    r = server.request("GET", "/api/kernelspecs")
    assert r.status_code == 200, r.text
    specs = r.json()
    assert specs["default"] == "python3"
    assert list(specs["kernelspecs"]) == ["python3"]
    spec = specs["kernelspecs"]["python3"]
    assert spec["spec"]["display_name"] == "Python 3 (sandboxed)"
    assert spec["spec"]["language"] == "python"
    logo_png, logo_svg = spec["resources"]["logo-64x64"], spec["resources"]["logo-svg"]
    assert logo_png.endswith("/kernelspecs/python3/logo-64x64.png"), logo_png
    r = server.request("GET", logo_png)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"] == "image/png"
    assert r.content.startswith(PNG_MAGIC)
    assert int.from_bytes(r.content[16:20], "big") == 64  # IHDR width
    assert r.content == gateway.request("GET", "/kernelspecs/python3/logo-64x64.png").content
    r = server.request("GET", logo_svg)
    assert r.status_code == 200, r.text
    assert b"<svg" in r.content
    r = server.request("GET", "/api/kernelspecs/python3")
    assert r.status_code == 200 and r.json()["name"] == "python3", r.text

    # Start: the kernel is the gateway's, under the same id.
    assert gateway.kernels() == []
    r = server.request("POST", "/api/kernels", json={"name": "python3"})
    assert r.status_code == 201, r.text
    kernel = r.json()
    kid = kernel["id"]
    assert kernel["name"] == "python3"
    assert [k["id"] for k in gateway.kernels()] == [kid]

    # List and get.
    r = server.request("GET", "/api/kernels")
    assert r.status_code == 200, r.text
    assert [k["id"] for k in r.json()] == [kid]
    r = server.request("GET", f"/api/kernels/{kid}")
    assert r.status_code == 200, r.text
    assert r.json()["execution_state"] in ("idle", "starting", "busy")

    # Execute over jupyter_server's channels WebSocket.
    ch = Channels(f"{server.ws_url}/api/kernels/{kid}/channels", server.token)
    try:
        msg = ch.send("shell", "kernel_info_request", {})
        reply = ch.wait_for(
            "kernel_info_reply",
            lambda m: m["msg_type"] == "kernel_info_reply" and m["parent_header"].get("msg_id") == msg,
        )
        assert reply["content"]["status"] == "ok"
        assert reply["content"]["language_info"]["name"] == "python"

        first = ch.execute("x = 41")
        assert first.reply["status"] == "ok", first.reply
        out = ch.execute("print('hello'); x + 1")
        assert out.reply["status"] == "ok", out.reply
        assert out.result == "42"
        assert out.stdout == "hello\n"
        assert out.reply["execution_count"] == first.reply["execution_count"] + 1

        # Interrupt a 60 s sleep through jupyter_server's REST API.
        started = time.monotonic()
        msg_id = ch.execute_start("import time; time.sleep(60)")
        ch.wait_for(
            "the sleep to start",
            lambda m: m["msg_type"] == "execute_input" and m["parent_header"].get("msg_id") == msg_id,
        )
        r = server.request("POST", f"/api/kernels/{kid}/interrupt", json={})
        assert r.status_code == 204, r.text
        out = ch.collect(msg_id, timeout=30)
        assert out.reply["status"] == "error", out.reply
        assert out.error["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - started < 30
        assert ch.execute("x").result == "41"  # state survives an interrupt

        # Restart through jupyter_server: same kernel id, state gone, the WebSocket still works.
        before = len(ch.seen)
        r = server.request("POST", f"/api/kernels/{kid}/restart", json={})
        assert r.status_code == 200, (
            f"restart through jupyter_server: {r.status_code} {r.text}\n"
            f"jupyter_server log:\n{server.log(15)}\ngateway log:\n{gateway.log(15)}"
        )
        assert r.json()["id"] == kid
        out = ch.execute("x")
        assert out.reply["status"] == "error", out.reply
        assert out.error["ename"] == "NameError"
        assert "'x' is not defined" in out.error["evalue"]
        assert [k["id"] for k in gateway.kernels()] == [kid]
        # jupyter_server sends IOPub status `restarting` only when its restarter brought a
        # dead kernel back; JupyterLab takes that status to mean "the kernel died" and says
        # so in a dialog. A restart the user asked for must not produce it.
        states = [
            m["content"]["execution_state"]
            for m in ch.seen[before:]
            if m["channel"] == "iopub" and m["msg_type"] == "status"
        ]
        assert "restarting" not in states, (
            f"the gateway announced a requested restart as an automatic one: statuses {states}"
        )
    finally:
        ch.close()

    # Shutdown: gone on jupyter_server and on the gateway.
    r = server.request("DELETE", f"/api/kernels/{kid}")
    assert r.status_code == 204, r.text
    assert server.request("GET", f"/api/kernels/{kid}").status_code == 404
    assert gateway.request("GET", f"/api/kernels/{kid}").status_code == 404
    assert gateway.kernels() == []
    assert server.request("GET", "/api/kernels").json() == []

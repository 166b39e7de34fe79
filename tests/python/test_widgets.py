"""ipywidgets over the gateway's channels WebSocket, as a widget manager speaks it: messages
built by jupyter_client's Session, sent as the JSON WebSocket protocol.

One kernel of the real image: a slider's comm opens with its state; a view's update reaches
the kernel and a kernel-side set reaches the view; ipywidgets 8's control comm answers a
request for every widget's state, again after the WebSocket is dropped and a new one opened
(a browser reload); and with a long cell running in the main shell, a widget update sent to
a kernel subshell (`subshell_id` in the header, JEP 91) is answered before that cell ends.
A restart closes the widgets' comms for the client; the agent API shows a widget as text.
"""

from __future__ import annotations

import json
import time
import uuid

import websocket
from jupyter_client.session import Session

from conftest import wait_until

WIDGET_TARGET = "jupyter.widget"
CONTROL_TARGET = "jupyter.widget.control"


class Channels:
    """One client session on /api/kernels/{id}/channels."""

    def __init__(self, gateway, kernel_id: str, session: str | None = None):
        self.session = Session(session=session or uuid.uuid4().hex, username="widgets")
        url = f"{gateway.ws_url}/api/kernels/{kernel_id}/channels?session_id={self.session.session}"
        self.ws = websocket.create_connection(url, header=[f"Authorization: token {gateway.token}"], timeout=90)
        self.ws.settimeout(60)
        self.seen: list[dict] = []

    def send(
        self, channel: str, msg_type: str, content: dict, subshell_id: str | None = None, metadata: dict | None = None
    ) -> str:
        msg = self.session.msg(msg_type, content, metadata=metadata)
        # Unique across Session objects of one session id (a reconnect reuses the id).
        msg["header"]["msg_id"] = msg["msg_id"] = uuid.uuid4().hex
        if subshell_id is not None:
            msg["header"]["subshell_id"] = subshell_id
        msg["channel"] = channel
        msg["buffers"] = []
        self.ws.send(json.dumps(msg, default=str))
        return msg["header"]["msg_id"]

    def recv(self) -> dict:
        msg = json.loads(self.ws.recv())
        self.seen.append(msg)
        return msg

    def wait_for(self, what: str, match) -> dict:
        """The first message received (and not yet taken) that matches."""
        for i, msg in enumerate(self.seen):
            if match(msg):
                return self.seen.pop(i)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                msg = self.recv()
            except websocket.WebSocketTimeoutException:
                break
            if match(msg):
                self.seen.remove(msg)
                return msg
        raise AssertionError(f"no {what} within 90 s; received: {[m['msg_type'] for m in self.seen][-30:]}")

    def execute(self, code: str, subshell_id: str | None = None) -> str:
        return self.send(
            "shell",
            "execute_request",
            {"code": code, "silent": False, "store_history": True, "user_expressions": {},
             "allow_stdin": False, "stop_on_error": True},
            subshell_id,
        )

    def reply_to(self, msg_id: str) -> dict:
        return self.wait_for(
            f"the reply to {msg_id}",
            lambda m: m["msg_type"].endswith("_reply") and m["parent_header"].get("msg_id") == msg_id,
        )

    def result_of(self, msg_id: str) -> str:
        reply = self.reply_to(msg_id)
        assert reply["content"]["status"] == "ok", reply["content"]
        out = self.wait_for(
            "its result",
            lambda m: m["msg_type"] == "execute_result" and m["parent_header"].get("msg_id") == msg_id,
        )
        return out["content"]["data"]["text/plain"]

    def comm_msg(self, comm_id: str, data: dict, subshell_id: str | None = None) -> str:
        return self.send("shell", "comm_msg", {"comm_id": comm_id, "data": data}, subshell_id)

    def all_states(self) -> dict:
        """Opens ipywidgets' control comm and asks for every widget's state, as the widget
        manager does when it connects."""
        control = uuid.uuid4().hex
        self.send(
            "shell", "comm_open", {"comm_id": control, "target_name": CONTROL_TARGET, "data": {}},
            metadata={"version": "1.0.0"},  # the control protocol's version, as the widget manager sends it
        )
        asked = self.comm_msg(control, {"method": "request_states"})
        answer = self.wait_for(
            "the update_states answer",
            lambda m: m["msg_type"] == "comm_msg"
            and m["content"]["comm_id"] == control
            and m["parent_header"].get("msg_id") == asked,
        )
        assert answer["content"]["data"]["method"] == "update_states", answer["content"]
        return answer["content"]["data"]["states"]

    def close(self):
        self.ws.close()


def test_widget_comms_through_the_gateway(gateway):
    r = gateway.request("POST", "/api/kernels", json={"name": "python3"})
    assert r.status_code == 201, r.text
    kernel_id = r.json()["id"]
    lab = Channels(gateway, kernel_id)

    # The kernel offers subshells, and says so through the gateway.
    info = lab.reply_to(lab.send("shell", "kernel_info_request", {}))
    assert "kernel subshells" in info["content"].get("supported_features", []), info["content"]

    # A slider: its comm opens with its state, and its display names the comm's model.
    shown = lab.execute("import ipywidgets as w\ns = w.IntSlider(value=5, description='x')\ns")
    opened = lab.wait_for(
        "the slider's comm_open",
        lambda m: m["msg_type"] == "comm_open"
        and m["content"]["data"].get("state", {}).get("_model_name") == "IntSliderModel",
    )
    assert opened["content"]["target_name"] == WIDGET_TARGET
    state = opened["content"]["data"]["state"]
    assert (state["value"], state["description"]) == (5, "x"), state
    slider = opened["content"]["comm_id"]
    view = lab.wait_for(
        "the slider's display",
        lambda m: m["msg_type"] == "execute_result" and m["parent_header"].get("msg_id") == shown,
    )
    assert view["content"]["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] == slider
    assert lab.reply_to(shown)["content"]["status"] == "ok"

    # The view moves the slider: the kernel sees 8.
    lab.comm_msg(slider, {"method": "update", "state": {"value": 8}, "buffer_paths": []})
    assert lab.result_of(lab.execute("s.value")) == "8"

    # The kernel sets 7: the view is told.
    lab.execute("s.value = 7")
    update = lab.wait_for(
        "the kernel's update of the slider",
        lambda m: m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == slider
        and m["content"]["data"].get("method") == "update"
        and m["content"]["data"]["state"].get("value") == 7,
    )
    assert update["channel"] == "iopub"

    # Every widget's state on request, over the control comm.
    states = lab.all_states()
    assert states[slider]["state"]["value"] == 7, states[slider]
    assert states[slider]["model_name"] == "IntSliderModel"

    # The WebSocket dropped and a new one opened (a reload: a new client session): the
    # state request is answered there, and the slider still follows the view.
    lab.close()
    lab = Channels(gateway, kernel_id)
    states = lab.all_states()
    assert states[slider]["state"]["value"] == 7, states[slider]
    lab.comm_msg(slider, {"method": "update", "state": {"value": 9}, "buffer_paths": []})
    assert lab.result_of(lab.execute("s.value")) == "9"

    # The same session reconnecting gets what the kernel sent while it was away.
    session = lab.session.session
    asked = lab.execute("s.value = 4")
    lab.close()
    lab = Channels(gateway, kernel_id, session=session)
    lab.wait_for(
        "the update sent while the client was away",
        lambda m: m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == slider
        and m["content"]["data"]["state"].get("value") == 4,
    )
    assert lab.reply_to(asked)["content"]["status"] == "ok"

    # A subshell answers a widget update while the main shell runs a long cell, which only
    # a later cell on the subshell ends.
    created = lab.reply_to(lab.send("control", "create_subshell_request", {}))
    assert created["content"]["status"] == "ok", created["content"]
    subshell = created["content"]["subshell_id"]
    # ipykernel 7.4 sends a comm's incoming messages to the subshell that last sent on it
    # (whatever subshell_id they carry), so the slider is last set from the subshell.
    lab.result_of(lab.execute("released = False\ns.value = 2\n1", subshell))
    long_cell = lab.execute("import time\nwhile not released:\n    time.sleep(0.05)\nprint('released')")
    lab.wait_for(
        "the long cell to start",
        lambda m: m["msg_type"] == "execute_input" and m["parent_header"].get("msg_id") == long_cell,
    )
    lab.comm_msg(slider, {"method": "update", "state": {"value": 3}, "buffer_paths": []}, subshell)
    on_subshell = lab.execute("s.value", subshell)
    assert lab.result_of(on_subshell) == "3"
    # The long cell still runs (only the next subshell cell ends it) and 3 was seen.
    lab.result_of(lab.execute("released = True\n1", subshell))
    assert lab.reply_to(long_cell)["content"]["status"] == "ok"

    # A restart ends the old process's comms: the gateway closes them for the client.
    r = gateway.request("POST", f"/api/kernels/{kernel_id}/restart")
    assert r.status_code == 200, r.text
    closed = lab.wait_for(
        "the slider's comm_close",
        lambda m: m["msg_type"] == "comm_close" and m["content"]["comm_id"] == slider,
    )
    assert closed["channel"] == "iopub"
    lab.close()

    # The gateway's own client, the agent API, shows the widget as text.
    r = gateway.request(
        "POST", f"/api/kernels/{kernel_id}/execute", json={"code": "import ipywidgets as w\nw.IntSlider(value=5, description='x')"}
    )
    assert r.status_code == 200, r.text
    text = r.json()["results"][0]["data"]["text/plain"]
    assert "IntSlider(value=5, description='x')" in text and "interactive in JupyterLab" in text, text

    r = gateway.request("DELETE", f"/api/kernels/{kernel_id}")
    assert r.status_code == 204, r.text
    wait_until("the kernel to go", lambda: gateway.kernels() == [], 30)

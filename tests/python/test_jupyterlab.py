"""JupyterLab end to end: `jupyter lab --gateway-url=<kernelgate>` in headless Chromium.

A user opens Lab, creates a notebook from the launcher card of the gateway's kernel spec and
works in it: every step below is something they would look at, and each leaves a screenshot
in artifacts/test_jupyterlab_notebook_on_gateway/.
"""

from __future__ import annotations

import json
import re
import time

from playwright.sync_api import Locator, expect

from conftest import Screens, loopback_only, wait_until

DISPLAY_NAME = "Python 3 (sandboxed)"  # the gateway's kernel spec, as the launcher shows it
CELL_TIMEOUT_MS = 90_000  # a cell on a loaded 2-core machine; the first one waits for the kernel
NOTEBOOK = "gateway-demo.ipynb"
UNKNOWN_FOR_S = 20  # how long a kernel status of "Unknown" lasts before a reconnect


class Lab(Screens):
    """The notebook a user works in, with the checks they would make by eye."""

    @property
    def panel(self) -> Locator:
        return self.page.locator(".jp-NotebookPanel:visible")

    @property
    def cells(self) -> Locator:
        return self.panel.locator(".jp-Notebook .jp-Cell")

    def wait_kernel_idle(self, timeout_ms: int = CELL_TIMEOUT_MS):
        """The status bar says the notebook's kernel is idle (it says "Initializing",
        "Connecting", "Restarting", "Busy"... before), and so does the toolbar indicator.

        A status that stays "Unknown" for UNKNOWN_FOR_S is reconnected once, as a user would
        (Kernel > Reconnect to Kernel): jupyter_server's gateway client can lose the
        notebook's first kernel_info_request when the browser's first WebSocket fails under
        load. The upstream connection it then cancels still opens, takes the session over
        from the one the notebook uses, and receives the reply (jupyter-lab.log: "Websocket
        connection has been closed via client disconnect", then "Lost connection to
        Gateway"). A kernel that does not answer stays Unknown after the reconnect too."""
        status = self.page.locator("#jp-main-statusbar")
        idle, unknown = f"{DISPLAY_NAME} | Idle", f"{DISPLAY_NAME} | Unknown"
        deadline = time.monotonic() + timeout_ms / 1000
        unknown_since = None
        reconnected = False
        while idle not in (text := status.inner_text()):
            now = time.monotonic()
            assert now < deadline, f"the kernel is not idle after {timeout_ms} ms: {text!r}"
            if unknown not in text:
                unknown_since = None
            elif unknown_since is None:
                unknown_since = now
            elif not reconnected and now - unknown_since > UNKNOWN_FOR_S:
                self.reconnect_kernel()
                reconnected = True
            time.sleep(0.25)
        expect(self.panel.locator(".jp-Notebook-ExecutionIndicator")).to_have_attribute(
            "data-status", "idle", timeout=timeout_ms
        )

    def reconnect_kernel(self):
        """Kernel > Reconnect to Kernel, from the menu bar."""
        self.page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").click()
        self.page.locator(".lm-Menu-itemLabel", has_text="Reconnect to Kernel").click()

    def type_in_last_cell(self, code: str) -> Locator:
        # By index: `.last` would follow the cell that Shift+Enter adds.
        cell = self.cells.nth(self.cells.count() - 1)
        editor = cell.locator(".cm-content")
        editor.click()
        # insert_text puts the line in as one input, so CodeMirror adds no closing brackets.
        self.page.keyboard.insert_text(code)
        # CodeMirror renders each line as an element of its own: no newlines in its text.
        expect(editor).to_have_text(code.replace("\n", ""))
        return cell

    def run(self, code: str, ran: bool = True) -> Locator:
        """Types `code` into the last (empty) cell, runs it with Shift+Enter and waits until its
        prompt shows an execution count, or, for code that never ran (`ran=False`), until it
        shows an error and no count (`[ ]:`, the space a no-break space). Returns the cell."""
        cell = self.start(code)
        if ran:
            prompt = re.compile(r"\[\d+\]:")
        else:
            expect(self.outputs(cell, "application/vnd.jupyter.stderr")).to_be_visible(timeout=CELL_TIMEOUT_MS)
            prompt = re.compile(r"^\[\s\]:$")
        expect(cell.locator(".jp-InputPrompt")).to_have_text(prompt, timeout=CELL_TIMEOUT_MS)
        return cell

    def start(self, code: str) -> Locator:
        n = self.cells.count()
        cell = self.type_in_last_cell(code)
        self.page.keyboard.press("Shift+Enter")
        expect(self.cells).to_have_count(n + 1)  # Shift+Enter on the last cell adds one
        return cell

    def outputs(self, cell: Locator, mime: str | None = None) -> Locator:
        sel = ".jp-OutputArea-output"
        if mime:
            sel += f'[data-mime-type="{mime}"]'
        return cell.locator(sel)

    def toolbar_button(self, command: str) -> Locator:
        return self.panel.locator(f'.jp-NotebookPanel-toolbar [data-command="{command}"]')


def log_frames(ws, out):
    """Writes one line per kernel message received on a channels WebSocket: time, channel,
    msg_type and, for status messages, the execution state."""

    def received(payload):
        if not isinstance(payload, str):
            out.write(f"{time.strftime('%H:%M:%S')} {ws.url} <binary {len(payload)} bytes>\n")
            return
        try:
            msg = json.loads(payload)
        except ValueError:
            return
        state = msg.get("content", {}).get("execution_state", "")
        parent = msg.get("parent_header", {}).get("msg_type", "")
        out.write(
            f"{time.strftime('%H:%M:%S')} {msg.get('channel')} {msg.get('msg_type')} {state}"
            f" (parent {parent or '-'})\n"
        )

    out.write(f"{time.strftime('%H:%M:%S')} open {ws.url}\n")
    ws.on("framereceived", received)
    ws.on("close", lambda _: out.write(f"{time.strftime('%H:%M:%S')} close {ws.url}\n"))


def session_kernel_ids(lab_server) -> list[str]:
    r = lab_server.request("GET", "/api/sessions")
    assert r.status_code == 200, r.text
    return [s["kernel"]["id"] for s in r.json()]


def test_jupyterlab_notebook_on_gateway(policy_gateway, jupyter_factory, chromium, artifacts):
    # The whole notebook runs under an execution policy: what it does not match runs as usual.
    gateway = policy_gateway
    server = jupyter_factory("lab", gateway)
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)

    # Only loopback is reachable here, and Lab must not try anything else: record and refuse.
    outside = loopback_only(context)
    page = context.new_page()
    console = open(artifacts / "browser-console.log", "w")
    page.on("console", lambda m: console.write(f"[{m.type}] {m.text}\n"))
    page.on("pageerror", lambda e: console.write(f"[pageerror] {e}\n"))
    frames = open(artifacts / "ws-frames.log", "w")  # kernel messages Lab received, abridged
    page.on("websocket", lambda ws: "/channels" in ws.url and log_frames(ws, frames))
    lab = Lab(page, artifacts)
    try:
        page.goto(f"{server.url}/lab?token={server.token}")

        # The launcher offers the gateway's kernel spec, with its logo proxied from the gateway.
        card = page.locator(f'.jp-LauncherCard[data-category="Notebook"][title="{DISPLAY_NAME}"]')
        expect(card).to_be_visible(timeout=90_000)
        logo = card.locator("img")
        wait_until("the kernel logo to load", lambda: logo.evaluate("i => i.complete && i.naturalWidth > 0"), 30)
        lab.shot("launcher")
        assert gateway.kernels() == []

        # A new notebook from that card: its kernel is started by the gateway.
        card.click()
        expect(lab.panel).to_be_visible()
        lab.wait_kernel_idle()
        expect(lab.panel.locator(".jp-KernelName")).to_have_text(DISPLAY_NAME)
        kernels = gateway.kernels()
        assert len(kernels) == 1, kernels
        kernel_id = kernels[0]["id"]
        assert session_kernel_ids(server) == [kernel_id]
        lab.shot("notebook-kernel-idle")

        # x = 41, then x + 1 shows 42.
        cell = lab.run("x = 41")
        expect(lab.outputs(cell)).to_have_count(0)
        cell = lab.run("x + 1")
        expect(lab.outputs(cell, "text/plain")).to_have_text("42")
        lab.shot("x-plus-1-is-42")

        # A cell the policy denies fails like any cell, with the rule's reason.
        # It never ran: its prompt shows no execution count (not the previous cell's).
        cell = lab.run("import subprocess\nsubprocess.run(['id'])", ran=False)
        err = lab.outputs(cell, "application/vnd.jupyter.stderr")
        expect(err).to_contain_text("PolicyViolation")
        expect(err).to_contain_text("no subprocesses in analyses")
        lab.shot("policy-denied")

        # A cell an `ask` rule holds waits, busy, until an admin approves it.
        cell = lab.start("import socket\ny = x + 1\nprint('approved', y)")
        expect(cell.locator(".jp-InputPrompt")).to_have_text("[*]:")
        expect(lab.outputs(cell, "application/vnd.jupyter.stderr")).to_contain_text(
            "waits for an administrator's approval", timeout=CELL_TIMEOUT_MS
        )
        lab.shot("policy-waiting")
        pending = wait_until(
            "the approval to be listed",
            lambda: gateway.request("GET", "/api/kernelgate/approvals").json(),
            30,
        )
        assert pending[0]["code"].startswith("import socket"), pending
        answer = gateway.request(
            "POST", f"/api/kernelgate/approvals/{pending[0]['id']}", json={"approve": True}
        )
        assert answer.status_code == 204, answer.text
        expect(lab.outputs(cell, "application/vnd.jupyter.stdout")).to_have_text(
            "approved 42", timeout=CELL_TIMEOUT_MS
        )
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"))
        lab.shot("policy-approved")

        # stdout and stderr both render, each in its own stream.
        cell = lab.run(
            'import sys; print("hello from stdout"); print("warning on stderr", file=sys.stderr)'
        )
        expect(lab.outputs(cell, "application/vnd.jupyter.stdout")).to_have_text(
            "hello from stdout"
        )
        expect(lab.outputs(cell, "application/vnd.jupyter.stderr")).to_have_text(
            "warning on stderr"
        )
        lab.shot("stdout-and-stderr")

        # A matplotlib plot renders as a PNG image.
        cell = lab.run(
            "import matplotlib.pyplot as plt; plt.plot([1, 4, 9, 16], 'o-'); plt.title('squares'); plt.show()"
        )
        img = lab.outputs(cell, "image/png").locator("img")
        expect(img).to_have_count(1)
        assert img.get_attribute("src").startswith("data:image/png;base64,")
        wait_until("the plot image to load", lambda: img.evaluate("i => i.complete && i.naturalWidth"), 10)
        width = img.evaluate("i => i.naturalWidth")
        assert width >= 200, f"plot image is only {width} px wide"
        img.scroll_into_view_if_needed()
        lab.shot("matplotlib-plot")

        # 1/0 renders the traceback.
        cell = lab.run("1/0")
        err = lab.outputs(cell, "application/vnd.jupyter.stderr")
        expect(err).to_contain_text("ZeroDivisionError")
        expect(err).to_contain_text("division by zero")
        expect(err).to_contain_text("Traceback")
        lab.shot("traceback")

        # time.sleep(60) is interrupted from the toolbar; KeyboardInterrupt shows.
        started = time.monotonic()
        cell = lab.start("import time; time.sleep(60)")
        expect(cell.locator(".jp-InputPrompt")).to_have_text("[*]:")
        expect(lab.panel.locator(".jp-Notebook-ExecutionIndicator")).to_have_attribute(
            "data-status", "busy"
        )
        lab.shot("sleep-running")
        lab.toolbar_button("notebook:interrupt-kernel").click()
        err = lab.outputs(cell, "application/vnd.jupyter.stderr")
        expect(err).to_contain_text("KeyboardInterrupt", timeout=30_000)
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"))
        assert time.monotonic() - started < 45, "the interrupt did not cut the 60 s sleep short"
        lab.wait_kernel_idle()
        lab.shot("interrupted")

        # The interrupt kept the kernel's state.
        cell = lab.run("x")
        expect(lab.outputs(cell, "text/plain")).to_have_text("41")

        # Close the notebook tab and open it again: Lab reconnects to the same kernel.
        lab.toolbar_button("docmanager:save").click()
        dialog = page.locator(".jp-Dialog")  # Lab asks for a name on the first save
        dialog.locator("input.jp-mod-styled").first.fill(NOTEBOOK)
        dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
        tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=NOTEBOOK)
        expect(tab).not_to_have_class(re.compile(r"jp-mod-dirty"))
        tab.locator(".lm-TabBar-tabCloseIcon").click()
        expect(lab.panel).to_have_count(0)
        lab.shot("notebook-closed")
        assert [k["id"] for k in gateway.kernels()] == [kernel_id]
        assert (server.root_dir / NOTEBOOK).is_file()  # notebook files stay on the Lab side
        page.locator(".jp-DirListing-item", has_text=NOTEBOOK).dblclick()
        expect(lab.panel).to_be_visible()
        lab.wait_kernel_idle()
        cell = lab.run("x")
        expect(lab.outputs(cell, "text/plain")).to_have_text("41")
        assert [k["id"] for k in gateway.kernels()] == [kernel_id]
        assert session_kernel_ids(server) == [kernel_id]
        lab.shot("reopened-same-kernel")

        # Restart from the Kernel menu: the state is gone, x raises NameError.
        page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Kernel$")).click()
        page.locator('.lm-Menu-item[data-command="kernelmenu:restart"]').click()
        dialog = page.locator(".jp-Dialog")
        expect(dialog).to_contain_text("Restart")
        lab.shot("restart-dialog")
        dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
        lab.wait_kernel_idle()
        # Lab shows "Kernel Restarting: ... appears to have died" when the server sends an
        # IOPub status `restarting`, which jupyter_server does only for an automatic restart
        # after a death, never for a restart the user asked for.
        expect(
            page.locator(".jp-Dialog"),
            "a dialog is open after a restart from the Kernel menu (see ws-frames.log)",
        ).to_have_count(0)
        cell = lab.run("x")
        err = lab.outputs(cell, "application/vnd.jupyter.stderr")
        expect(err).to_contain_text("NameError")
        expect(err).to_contain_text("'x' is not defined")
        assert [k["id"] for k in gateway.kernels()] == [kernel_id]
        lab.shot("restarted-nameerror")

        assert outside == [], f"JupyterLab tried to reach outside loopback: {outside}"
    except BaseException:
        lab.shot("failure")
        raise
    finally:
        console.close()
        frames.close()
        context.close()

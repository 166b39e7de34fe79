"""The gateway's own web page at `/`, in headless Chromium against the real gateway, real Docker
and a real ipykernel.

A user opens the page, enters the token, starts a kernel and runs cells with Shift+Enter; each
step checks what they would look at and leaves a screenshot in artifacts/test_ui_console/.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

import requests
from playwright.sync_api import Locator, expect

from conftest import Screens

CELL_TIMEOUT_MS = 90_000  # the first cell on a loaded 2-core machine waits for the kernel


class Console(Screens):
    """The page, with the checks a user would make by eye."""

    def before_shot(self) -> None:
        """What the user sees: the window scrolled to the newest run."""
        if self.page.locator("#log .run").count():
            # The newest run sits just above the editor at the bottom of the page.
            self.page.evaluate("window.scrollTo(0, document.body.scrollHeight)")

    @property
    def status(self) -> Locator:
        return self.page.locator("#kernel-status")

    def wait_status(self, state: str, timeout_ms: int = CELL_TIMEOUT_MS):
        expect(self.status).to_have_attribute("data-state", state, timeout=timeout_ms)

    def start(self, code: str) -> Locator:
        """Types `code` and presses Shift+Enter; returns the new run's element."""
        runs = self.page.locator("#log .run")
        n = runs.count()
        editor = self.page.locator("#code")
        editor.fill(code)
        editor.press("Shift+Enter")
        expect(runs).to_have_count(n + 1)
        expect(editor).to_have_value("")  # the editor empties for the next cell
        return runs.nth(n)

    def run(self, code: str, outcome: str = "ok", ran: bool = True) -> Locator:
        """Runs `code` and waits for the kernel's reply (`ok` or `error`); its prompt shows
        an execution count, or `[ ]` for code that never ran (`ran=False`)."""
        run = self.start(code)
        expect(run).to_have_class(re.compile(rf"\bstatus-{outcome}\b"), timeout=CELL_TIMEOUT_MS)
        prompt = r"In \[\d+\]:" if ran else r"In \[ \]:"
        expect(run.locator(".prompt-label")).to_have_text(re.compile(prompt))
        return run

    def log_in_and_start_kernel(self, gateway) -> None:
        """Opens the page, logs in with the token, starts a kernel and waits until it is idle."""
        self.page.goto(gateway.url + "/")
        self.page.locator("#token").fill(gateway.token)
        self.page.locator("#connect").click()
        self.page.locator("#new-kernel").click()
        self.wait_status("idle")


def test_ui_console(gateway, chromium, artifacts):
    # The page and its files are public and say what may load; the API still wants the token.
    index = requests.get(gateway.url + "/", timeout=10)
    assert index.status_code == 200
    assert index.headers["content-type"].startswith("text/html")
    csp = index.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp, csp
    assert "connect-src 'self' ws: wss:" in csp, csp
    assert index.headers["x-content-type-options"] == "nosniff"
    assert gateway.token not in index.text
    js = requests.get(gateway.url + "/ui/app.js", timeout=10)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    css = requests.get(gateway.url + "/ui/style.css", timeout=10)
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert requests.get(gateway.url + "/ui/../api/kernels", timeout=10).status_code in (401, 403, 404)
    assert requests.get(gateway.url + "/ui/nope.js", timeout=10).status_code == 404
    assert requests.get(gateway.url + "/api/kernels", timeout=10).status_code in (401, 403)

    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    page = context.new_page()
    origin = urlparse(gateway.url).netloc
    foreign: list[str] = []
    problems: list[str] = []
    log = open(artifacts / "browser-console.log", "w")

    def on_request(req):
        u = urlparse(req.url)
        if u.scheme not in ("data", "about") and u.netloc != origin:
            foreign.append(req.url)

    def on_console(m):
        log.write(f"[{m.type}] {m.text}\n")
        log.flush()
        # A Content-Security-Policy violation is reported as a console error. The wrong-token
        # step below makes the browser log its refused request (403); that one is expected.
        # The sandboxed frame refusing the hostile output's scripts is expected too.
        expected = ("status of 403", "Blocked script execution in 'about:srcdoc'")
        if m.type == "error" and not any(e in m.text for e in expected):
            problems.append(m.text)

    page.on("request", on_request)
    page.on("console", on_console)
    page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
    ui = Console(page, artifacts)
    try:
        page.goto(gateway.url + "/")
        expect(page.locator("#token")).to_be_visible()
        ui.shot("token-prompt")

        # A wrong token is refused, and says so.
        page.locator("#token").fill("not-the-token")
        page.locator("#connect").click()
        expect(page.locator("#notice")).to_contain_text("rejected this token")
        expect(page.locator("#kernel-bar")).to_be_hidden()

        page.locator("#token").fill(gateway.token)
        page.locator("#connect").click()
        expect(page.locator("#kernel-bar")).to_be_visible()
        assert gateway.token not in page.url
        assert page.evaluate("sessionStorage.getItem('kernelgate.token')") == gateway.token

        # No kernel yet: start one from the page; the status indicator follows it live.
        page.locator("#new-kernel").click()
        ui.wait_status("idle")
        kernels = gateway.kernels()
        assert len(kernels) == 1
        kernel_id = kernels[0]["id"]
        expect(page.locator("#kernel-select")).to_have_value(kernel_id)
        ui.shot("kernel-started")

        # A plot: the PNG from matplotlib's inline backend shows as a decoded image.
        plot = ui.run("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
        img = plot.locator('.output-rich[data-mime="image/png"] img')
        expect(img).to_be_visible()
        size = img.evaluate("i => i.decode().then(() => [i.naturalWidth, i.naturalHeight])")
        assert size[0] > 100 and size[1] > 100, size
        assert img.get_attribute("src").startswith("data:image/png;base64,")
        ui.shot("plot")

        # An error: the traceback is readable text with the kernel's ANSI colours as styles.
        err = ui.run("1/0", outcome="error")
        tb = err.locator(".error-output")
        expect(tb).to_contain_text("ZeroDivisionError")
        expect(tb).to_contain_text("division by zero")
        text = tb.inner_text()
        assert "\x1b" not in text and "[0;" not in text and "[31m" not in text, text
        coloured = tb.locator("span[class*='ansi-fg-'], span[style*='color']")
        assert coloured.count() >= 2, tb.inner_html()
        colours = set(coloured.evaluate_all("spans => spans.map(s => getComputedStyle(s).color)"))
        assert len(colours) >= 2, colours
        assert err.locator(".prompt-label").inner_text() == "In [2]:"
        ui.shot("traceback")

        # stdout and stderr, as separate blocks; output text is never parsed as HTML.
        streams = ui.run(
            "print('a')\nimport sys\nprint('b', file=sys.stderr)\n"
            "print('\\x1b[31m<b>red</b>\\x1b[0m & <script>x</script>')"
        )
        # (the kernel batches each stream, so stdout's two lines may arrive as one block)
        stdout = streams.locator(".stream-stdout")
        expect(streams.locator(".stream-stderr")).to_have_text("b\n")
        assert "".join(stdout.all_inner_texts()) == "a\n<b>red</b> & <script>x</script>\n"
        assert stdout.locator("b, script").count() == 0
        last_out = stdout.last
        expect(last_out.locator("span.ansi-fg-red")).to_have_text("<b>red</b>")
        ui.shot("streams")

        # A DataFrame: its HTML table in a frame that runs no scripts.
        table = ui.run(
            "import pandas as pd\n"
            "df = pd.DataFrame({'city': ['Oslo', 'Lima', 'Pune'], 'temp': [4.5, 19.0, 31.25]})\n"
            "df"
        )
        frame_el = table.locator('.output-rich[data-mime="text/html"] iframe')
        expect(frame_el).to_be_visible()
        sandbox = frame_el.get_attribute("sandbox")
        assert sandbox is not None and "allow-scripts" not in sandbox, sandbox
        frame = table.frame_locator("iframe")
        expect(frame.locator("table.dataframe")).to_be_visible()
        expect(frame.locator("tbody tr")).to_have_count(3)
        expect(frame.locator("tbody tr").nth(2)).to_contain_text("Pune")
        expect(frame.locator("tbody tr").nth(2)).to_contain_text("31.25")
        expect(table.locator(".out-label")).to_have_text(re.compile(r"Out\[\d+\]:"))
        assert frame_el.evaluate("f => f.getBoundingClientRect().height") >= 80
        ui.shot("dataframe")

        # Hostile HTML and SVG outputs run nothing in the page.
        ui.run(
            "from IPython.display import HTML, SVG, display\n"
            "display(HTML('<b>bold</b><img src=\"data:image/png;base64,AAAA\" onerror=\"parent.document.body.dataset.pwned=1\">"
            "<script>parent.document.body.dataset.pwned=2</script>'))\n"
            "display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"120\" height=\"40\">"
            "<rect width=\"120\" height=\"40\" fill=\"teal\"/>"
            "<script>parent.document.body.dataset.pwned=3</script></svg>'))"
        )
        svg = page.locator('#log .run').last.locator('.output-rich[data-mime="image/svg+xml"] img')
        expect(svg).to_be_visible()
        assert svg.evaluate("i => i.decode().then(() => i.naturalWidth)") == 120
        page.wait_for_timeout(500)
        assert page.evaluate("document.body.dataset.pwned") is None

        # Output streams in while the cell runs, and the status says busy meanwhile.
        slow = ui.start("import time\nfor i in range(4):\n    print('tick', i, flush=True)\n    time.sleep(1.5)")
        expect(slow.locator(".stream-stdout")).to_contain_text("tick 0", timeout=CELL_TIMEOUT_MS)
        expect(slow).to_have_class(re.compile(r"\brunning\b"))
        ui.wait_status("busy", timeout_ms=5_000)
        ui.shot("streaming")
        expect(slow).to_have_class(re.compile(r"\bstatus-ok\b"), timeout=CELL_TIMEOUT_MS)
        expect(slow.locator(".stream-stdout")).to_have_text("tick 0\ntick 1\ntick 2\ntick 3\n")
        ui.wait_status("idle")

        # Interrupt stops a long run with KeyboardInterrupt.
        long = ui.start("import time\ntime.sleep(120)")
        ui.wait_status("busy")
        page.locator("#interrupt").click()
        expect(long.locator(".error-output")).to_contain_text("KeyboardInterrupt", timeout=30_000)
        expect(long).to_have_class(re.compile(r"\bstatus-error\b"))
        ui.shot("interrupted")

        # A reload keeps the token (sessionStorage) and the kernel; nothing asks again.
        page.reload()
        expect(page.locator("#kernel-bar")).to_be_visible()
        expect(page.locator("#token-form")).to_be_hidden()
        ui.wait_status("idle")
        expect(page.locator("#kernel-select")).to_have_value(kernel_id)
        again = ui.run("print('df' in globals())")
        expect(again.locator(".stream-stdout")).to_have_text("True\n")
        ui.shot("reloaded")

        assert foreign == [], f"the page loaded from elsewhere: {foreign}"
        assert problems == [], f"browser errors (CSP violations included): {problems}"
    except BaseException:
        ui.shot("failure")
        raise
    finally:
        log.close()
        context.close()


def test_ui_restart(gateway, chromium, artifacts):
    """The Restart button gives a fresh kernel: state gone, execution count back to 1, and the
    page still connected to the same kernel id."""
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    page = context.new_page()
    ui = Console(page, artifacts)
    try:
        ui.log_in_and_start_kernel(gateway)
        kernel_id = gateway.kernels()[0]["id"]
        ui.run("x = 41")
        before = ui.run("print(x + 1)")
        expect(before.locator(".stream-stdout")).to_have_text("42\n")

        page.locator("#restart").click()
        # The button is disabled while the gateway restarts the kernel, whatever the outcome.
        expect(page.locator("#restart")).to_be_enabled(timeout=CELL_TIMEOUT_MS)
        expect(page.locator("#notice")).to_be_hidden()  # else it shows "Restart failed: ..."
        expect(page.locator("#log")).to_contain_text("kernel restarted")
        ui.wait_status("idle")
        after = ui.run("print('x' in globals())")
        expect(after.locator(".stream-stdout")).to_have_text("False\n")
        expect(after.locator(".prompt-label")).to_have_text("In [1]:")
        assert [k["id"] for k in gateway.kernels()] == [kernel_id]
        ui.shot("restarted")
    except BaseException:
        ui.shot("failure")
        raise
    finally:
        context.close()


def test_ui_newest_output_ends_above_the_prompt(gateway, chromium, artifacts):
    """After several long outputs, the page has scrolled by itself to the newest one: all of
    it is inside the window, below the top bar and above the sticky prompt, and its last
    line is what the user sees there, not the prompt drawn over it."""
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    page = context.new_page()
    ui = Console(page, artifacts)
    try:
        ui.log_in_and_start_kernel(gateway)
        for n in range(4):
            run = ui.run(f"for i in range(25): print('cell {n} line', i)")
            out = run.locator(".stream-stdout")
            expect(out).to_contain_text(f"cell {n} line 24")
            box = out.bounding_box()
            prompt = page.locator(".prompt").bounding_box()
            bar = page.locator(".topbar").bounding_box()
            assert box is not None and prompt is not None and bar is not None
            where = f"cell {n}: output {box}, prompt {prompt}, top bar {bar}"
            assert box["y"] >= bar["y"] + bar["height"], where
            assert box["y"] + box["height"] <= prompt["y"], where
            assert box["y"] + box["height"] <= 900, where
            # What is drawn at the output's last line is the output itself.
            last_line = page.evaluate(
                "([x, y]) => { const e = document.elementFromPoint(x, y);"
                " return e ? (e.closest('.stream-stdout') ? 'output' : e.className) : null; }",
                [box["x"] + 20, box["y"] + box["height"] - 6],
            )
            assert last_line == "output", f"{where}: {last_line!r} is drawn over its last line"
        # No before_shot scrolling here: the screenshot is what the page scrolled to.
        page.screenshot(path=str(artifacts / "newest-output.png"))
    except BaseException:
        ui.shot("failure")
        raise
    finally:
        context.close()


def test_ui_printed_url_logs_in_and_forgets_the_token(gateway, chromium, artifacts):
    """The URL the gateway prints (`/?token=T`) logs the page in; the token then leaves the
    address bar (and the history), so a copied or shared URL does not carry it."""
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    page = context.new_page()
    ui = Console(page, artifacts)
    try:
        page.goto(f"{gateway.url}/?token={gateway.token}")
        expect(page.locator("#kernel-bar")).to_be_visible()
        assert "token" not in page.url, page.url
        assert gateway.token not in page.evaluate("location.href + history.length + document.referrer")
        ui.shot("logged-in-from-url")
    except BaseException:
        ui.shot("failure")
        raise
    finally:
        context.close()


def test_ui_approvals(policy_gateway, chromium, artifacts):
    """An admin answers the executions the policy holds from the console: the waiting code,
    its rule's reason and who asked are listed with Approve and Deny buttons; approved code
    runs, denied code fails with PolicyViolation and never runs."""
    gateway = policy_gateway
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    page = context.new_page()
    ui = Console(page, artifacts)
    panel = page.locator("#approvals")
    try:
        ui.log_in_and_start_kernel(gateway)
        expect(panel).to_be_hidden()  # nothing waits

        # Denied outright: a failed run, nothing to approve.
        # It never ran: its prompt shows no execution count.
        denied = ui.run("import subprocess", outcome="error", ran=False)
        expect(denied.locator(".error-output")).to_contain_text("PolicyViolation")
        expect(denied.locator(".error-output")).to_contain_text("no subprocesses in analyses")
        expect(panel).to_be_hidden()

        # Held: the run waits and the panel lists it.
        held = ui.start("import socket\nanswer = 6 * 7\nprint('ran', answer)")
        expect(held.locator(".stream-stderr")).to_contain_text("waits for an administrator's approval")
        ui.wait_status("busy")
        item = panel.locator(".approval")
        expect(item).to_have_count(1)
        expect(item).to_contain_text("network access needs a person's OK")
        expect(item.locator("pre")).to_have_text("import socket\nanswer = 6 * 7\nprint('ran', answer)")
        expect(item).to_contain_text("key admin")
        ui.shot("approval-waiting")
        item.locator("button.approve").click()
        expect(held).to_have_class(re.compile(r"\bstatus-ok\b"), timeout=CELL_TIMEOUT_MS)
        expect(held.locator(".stream-stdout")).to_have_text("ran 42\n")
        expect(panel).to_be_hidden()
        ui.shot("approved")

        # Denied from the console: the code never runs.
        held = ui.start("import socket\nleaked = 1")
        expect(item).to_have_count(1, timeout=CELL_TIMEOUT_MS)
        item.locator("button.deny").click()
        expect(held).to_have_class(re.compile(r"\bstatus-error\b"), timeout=CELL_TIMEOUT_MS)
        expect(held.locator(".error-output")).to_contain_text("PolicyViolation")
        expect(held.locator(".error-output")).to_contain_text("denied")
        check = ui.run("print('leaked' in globals())")
        expect(check.locator(".stream-stdout")).to_have_text("False\n")
        assert gateway.request("GET", "/api/kernelgate/approvals").json() == []
        ui.shot("denied")
    except BaseException:
        ui.shot("failure")
        raise
    finally:
        context.close()

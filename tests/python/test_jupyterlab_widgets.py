"""ipywidgets in JupyterLab 4.6 (headless Chromium, `--gateway-url` at kernelgate): the widget
manager of jupyterlab_widgets renders the kernel image's ipywidgets through the gateway.

A slider renders with its value; `s.value = 7` in the kernel moves it; an arrow key on its
handle makes the kernel see 8; an `interact` over a function redraws its output when its
slider moves; after a page reload the slider is back with its value (the widget manager asks
the kernel for every widget's state over its control comm). Screenshots of each step in
artifacts/test_jupyterlab_widgets/.
"""

from __future__ import annotations

import re

from playwright.sync_api import expect

from conftest import loopback_only
from test_jupyterlab import CELL_TIMEOUT_MS, DISPLAY_NAME, Lab, log_frames

NOTEBOOK = "widgets.ipynb"


def test_jupyterlab_widgets(gateway, jupyter_factory, chromium, artifacts):
    server = jupyter_factory("lab", gateway)
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    outside = loopback_only(context)
    page = context.new_page()
    console = open(artifacts / "browser-console.log", "w")
    page.on("console", lambda m: console.write(f"[{m.type}] {m.text}\n"))
    page.on("pageerror", lambda e: console.write(f"[pageerror] {e}\n"))
    frames = open(artifacts / "ws-frames.log", "w")
    page.on("websocket", lambda ws: "/channels" in ws.url and log_frames(ws, frames))
    lab = Lab(page, artifacts)
    try:
        page.goto(f"{server.url}/lab?token={server.token}")
        card = page.locator(f'.jp-LauncherCard[data-category="Notebook"][title="{DISPLAY_NAME}"]')
        expect(card).to_be_visible(timeout=90_000)
        card.click()
        expect(lab.panel).to_be_visible()
        lab.wait_kernel_idle()

        # A slider renders, showing its value.
        cell = lab.run("import ipywidgets as w\ns = w.IntSlider(value=5, description='x')\ns")
        view = cell.locator(".jp-Cell-outputArea")
        readout = view.locator(".widget-readout")
        expect(view.locator(".widget-slider")).to_be_visible(timeout=CELL_TIMEOUT_MS)
        expect(view.locator(".widget-label")).to_have_text("x")
        expect(readout).to_have_text("5")
        lab.shot("slider")

        # The kernel sets the value: the view follows.
        lab.run("s.value = 7")
        expect(readout).to_have_text("7")
        lab.shot("kernel-set-7")

        # An arrow key on the handle: the kernel sees 8.
        view.locator(".noUi-handle").focus()
        page.keyboard.press("ArrowRight")
        expect(readout).to_have_text("8")
        cell = lab.run("s.value")
        expect(lab.outputs(cell, "text/plain")).to_have_text("8")
        lab.shot("arrow-key-8")

        # interact redraws its output when its slider moves.
        cell = lab.run(
            "from ipywidgets import interact\n"
            "@interact(n=(0, 10))\n"
            "def square(n=3):\n"
            "    print('square', n * n)"
        )
        view = cell.locator(".jp-Cell-outputArea")
        expect(view).to_contain_text("square 9", timeout=CELL_TIMEOUT_MS)
        view.locator(".noUi-handle").focus()
        page.keyboard.press("ArrowRight")
        expect(view).to_contain_text("square 16")
        expect(view).not_to_contain_text("square 9")
        lab.shot("interact-redrawn")

        # Saved, then the page reloaded: the slider is back with its value.
        lab.toolbar_button("docmanager:save").click()
        dialog = page.locator(".jp-Dialog")  # Lab asks for a name on the first save
        dialog.locator("input.jp-mod-styled").first.fill(NOTEBOOK)
        dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
        tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=NOTEBOOK)
        expect(tab).not_to_have_class(re.compile(r"jp-mod-dirty"))
        page.reload()
        expect(lab.panel).to_be_visible(timeout=90_000)
        lab.wait_kernel_idle()
        first = lab.cells.nth(0).locator(".jp-Cell-outputArea")
        expect(first.locator(".widget-readout")).to_have_text("8", timeout=CELL_TIMEOUT_MS)
        lab.shot("reloaded")
        assert len(gateway.kernels()) == 1

        assert outside == [], f"JupyterLab tried to reach outside loopback: {outside}"
    except BaseException:
        lab.shot("failure")
        raise
    finally:
        console.close()
        frames.close()
        context.close()

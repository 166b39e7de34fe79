"""JupyterLab and hibernation: a notebook whose kernel hibernated while its tab stayed open
runs its next cell with the old variables. Beyond a short wait for the resume, the user sees
nothing: same kernel, next execution count, no dialog.

Screenshots and logs in artifacts/test_notebook_resumes_after_hibernation/.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from playwright.sync_api import expect

from conftest import loopback_only, start_gateway, stop_gateway, wait_until
from test_jupyterlab import CELL_TIMEOUT_MS, DISPLAY_NAME, Lab, log_frames, session_kernel_ids

HIBERNATE_AFTER = 3  # seconds without a kernel message
RESUME_WITHIN = 45  # seconds from Shift+Enter to the first result after a resume (a cold start)


@pytest.fixture
def hibernating_gateway(artifacts):
    gw = start_gateway(artifacts / "gateway.log", ["--hibernate-after", str(HIBERNATE_AFTER)])
    yield gw
    stop_gateway(gw)


def containers_of(gateway) -> list[str]:
    return subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=org.kernelgate.runtime_dir={gateway.runtime_dir}"],
        capture_output=True, text=True, check=True,
    ).stdout.split()


def test_notebook_resumes_after_hibernation(hibernating_gateway, jupyter_factory, chromium, artifacts):
    gateway = hibernating_gateway
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

    def model() -> dict:
        r = gateway.request("GET", f"/api/kernels/{kernel_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def prompt(cell) -> str:
        return cell.locator(".jp-InputPrompt").inner_text().strip()

    try:
        page.goto(f"{server.url}/lab?token={server.token}")
        card = page.locator(f'.jp-LauncherCard[data-category="Notebook"][title="{DISPLAY_NAME}"]')
        expect(card).to_be_visible(timeout=90_000)
        card.click()
        expect(lab.panel).to_be_visible()
        lab.wait_kernel_idle()
        kernels = gateway.kernels()
        assert len(kernels) == 1, kernels
        kernel_id = kernels[0]["id"]
        assert session_kernel_ids(server) == [kernel_id]

        # Some state: a number and a NumPy array.
        cell = lab.run("x = 41")
        assert prompt(cell) == "[1]:"
        cell = lab.run("import numpy as np; arr = np.arange(5)")
        assert prompt(cell) == "[2]:"
        cell = lab.run("x + 1")
        expect(lab.outputs(cell, "text/plain")).to_have_text("42")
        assert prompt(cell) == "[3]:"
        # Checked at once, well within --hibernate-after: the hibernation below is the one
        # that comes while the tab sits open.
        assert model()["hibernated"] is False
        lab.shot("before-hibernation")

        # The tab stays open; the kernel hibernates: no container, the WebSocket still there.
        started = time.monotonic()
        asleep = wait_until("the kernel to hibernate", lambda: (m := model())["hibernated"] and m, 60)
        print(f"hibernated {time.monotonic() - started:.1f} s after the last result")
        assert asleep["execution_state"] == "idle", asleep
        assert asleep["connections"] >= 1, asleep
        assert containers_of(gateway) == []
        expect(page.locator(".jp-Dialog")).to_have_count(0)
        lab.wait_kernel_idle(timeout_ms=5_000)
        lab.shot("hibernated-tab-open")

        # The next cell wakes it, in the same tab: old variables, next execution counts.
        started = time.monotonic()
        cell = lab.run("x + 1")
        resumed_in = time.monotonic() - started
        print(f"first cell after the hibernation ran in {resumed_in:.1f} s")
        expect(lab.outputs(cell, "text/plain")).to_have_text("42")
        assert prompt(cell) == "[4]:"
        assert resumed_in < RESUME_WITHIN, f"the resume took {resumed_in:.1f} s"
        # Checked before the next --hibernate-after passes.
        assert model()["hibernated"] is False
        cell = lab.run("arr.sum()")
        # NumPy 2's repr: the array came back as an array, not as a list.
        expect(lab.outputs(cell, "text/plain")).to_have_text("np.int64(10)")
        assert prompt(cell) == "[5]:"
        assert model()["hibernated"] is False
        lab.wait_kernel_idle()
        expect(page.locator(".jp-Dialog"), "a dialog is open after the resume (see ws-frames.log)").to_have_count(0)
        assert [k["id"] for k in gateway.kernels()] == [kernel_id]
        assert session_kernel_ids(server) == [kernel_id]
        lab.shot("resumed-old-variables")

        assert outside == [], f"JupyterLab tried to reach outside loopback: {outside}"
    except BaseException:
        lab.shot("failure")
        raise
    finally:
        console.close()
        frames.close()
        context.close()

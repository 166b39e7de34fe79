"""JupyterLab with a gateway that offers a second kernel spec: an image derived from ours
with the fixture package (tests/fixtures/kg_fixture, built by `make fixture-image` with
kernel-image/derive.sh), kept warm in its own pool.

The user sees both specs in Lab's launcher, each with its own name and logo, opens a notebook
on the derived one and imports the package that only that image has.
"""

from __future__ import annotations

import os

import pytest
from playwright.sync_api import expect

from conftest import loopback_only, start_gateway, stop_gateway, wait_until
from test_jupyterlab import CELL_TIMEOUT_MS, Lab

FIXTURE_NAME = "Python 3 + kg_fixture"  # the image's org.kernelgate.display_name label


@pytest.fixture
def gateway_with_fixture(artifacts):
    image = os.environ.get("KERNELGATE_FIXTURE_IMAGE")
    if not image:
        pytest.fail("KERNELGATE_FIXTURE_IMAGE is not set: run through `make python-tests`")
    gw = start_gateway(
        artifacts / "gateway.log",
        ["--kernelspec", f"fixture={image}", "--pool-size", "0,fixture=1"],
    )
    yield gw
    stop_gateway(gw)


def test_lab_launcher_offers_the_derived_kernelspec(gateway_with_fixture, jupyter_factory, chromium, artifacts):
    gateway = gateway_with_fixture
    server = jupyter_factory("lab", gateway)
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    outside = loopback_only(context)
    page = context.new_page()
    lab = Lab(page, artifacts)
    try:
        page.goto(f"{server.url}/lab?token={server.token}")
        cards = page.locator('.jp-LauncherCard[data-category="Notebook"]')
        fixture_card = cards.and_(page.locator(f'[title="{FIXTURE_NAME}"]'))
        expect(fixture_card).to_be_visible(timeout=90_000)
        expect(cards.and_(page.locator('[title="Python 3 (sandboxed)"]'))).to_be_visible()
        logo = fixture_card.locator("img")
        wait_until("the fixture logo to load", lambda: logo.evaluate("i => i.complete && i.naturalWidth > 0"), 30)
        # The fixture's own logo (64x64, teal), not the default one.
        assert logo.evaluate("i => i.naturalWidth") == 64
        assert "/kernelspecs/fixture/" in logo.get_attribute("src")
        lab.shot("launcher-two-specs")

        fixture_card.click()
        expect(lab.panel).to_be_visible()
        expect(page.locator("#jp-main-statusbar")).to_contain_text(
            f"{FIXTURE_NAME} | Idle", timeout=CELL_TIMEOUT_MS
        )
        kernels = gateway.kernels()
        assert [k["name"] for k in kernels] == ["fixture"], kernels

        cell = lab.run("import kg_fixture; kg_fixture.greet('lab')")
        expect(lab.outputs(cell, "text/plain")).to_have_text("'hello lab from kg_fixture 1.2.3'")
        lab.shot("fixture-imported")
        assert outside == [], f"JupyterLab tried to reach outside loopback: {outside}"
    except BaseException:
        lab.shot("failure")
        raise
    finally:
        context.close()

"""Agent frameworks that run their code in E2B, unmodified, against the gateway's E2B surface
(docs/e2b.md, "Agent frameworks").

smolagents' `E2BExecutor` (pinned in requirements.txt) is what its `CodeAgent` hands each code
action to when run with `executor_type="e2b"`. The test drives the executor directly, as the
agent would, with no language model: the executor makes its sandbox with
`e2b_code_interpreter.Sandbox.create(**kwargs)` pointed at the gateway, installs its
`additional_imports` with `!pip install` (here an allowlisted package of a wheelhouse synced
from the fixture wheels of tests/packages/make_wheels.py, offline), then a multi-step task
keeps its state from step to step, gets a chart back as a PIL image, has an error reported
as the framework's `AgentError` naming the exception, and ends with the framework's
`final_answer`. A package off the allowlist is refused, and the framework's log says so.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from conftest import ARTIFACTS, REPO, Gateway, start_gateway, stop_gateway

from rich.console import Console
from smolagents.default_tools import FinalAnswerTool
from smolagents.monitoring import AgentLogger, LogLevel
from smolagents.remote_executors import E2BExecutor
from smolagents.utils import AgentError

# kgfix-app 2.0 brings kgfix-dep 0.3 along; neither is in the kernel image.
ALLOWLIST = "kgfix-app\n"


@pytest.fixture(scope="module")
def gw(tmp_path_factory) -> Iterator[Gateway]:
    """A gateway (warm pool of 2) whose kernels may install kgfix-app from a wheelhouse
    synced here from the fixture wheels, with no index."""
    artifacts = ARTIFACTS / "test_e2b_frameworks"
    artifacts.mkdir(parents=True, exist_ok=True)
    work = tmp_path_factory.mktemp("packages")
    wheels = work / "fixture-wheels"
    subprocess.run(
        [sys.executable, str(REPO / "tests" / "packages" / "make_wheels.py"), str(wheels)],
        check=True, capture_output=True, timeout=120,
    )
    allowlist = work / "allowed.txt"
    allowlist.write_text(ALLOWLIST)
    wheelhouse = work / "wheelhouse"
    binary = os.environ.get("KERNELGATE_BIN", str(REPO / "target" / "debug" / "kernelgate"))
    image = os.environ.get("KERNELGATE_IMAGE", "kernelgate-kernel:latest")
    # The runtime comes from KERNELGATE_RUNTIME, as for `serve`.
    synced = subprocess.run(
        [binary, "packages", "sync", "--packages", str(allowlist), "--wheelhouse", str(wheelhouse),
         "--find-links", str(wheels), "--image", image, "--python", sys.executable],
        capture_output=True, text=True, timeout=300,
    )
    (artifacts / "sync.log").write_text(synced.stdout + synced.stderr)
    assert synced.returncode == 0, synced.stderr
    gw = start_gateway(
        artifacts / "gateway.log",
        ["--pool-size", "2", "--packages", str(allowlist), "--wheelhouse", str(wheelhouse)],
    )
    try:
        yield gw
    finally:
        stop_gateway(gw)


class Log:
    """smolagents' own AgentLogger, printing into a string the test reads."""

    def __init__(self):
        self.buffer = io.StringIO()
        console = Console(file=self.buffer, width=10_000, highlight=False, markup=False,
                          color_system=None)
        self.logger = AgentLogger(level=LogLevel.DEBUG, console=console)

    def text(self) -> str:
        return self.buffer.getvalue()


def executor(gw: Gateway, additional_imports: list[str], log: Log) -> E2BExecutor:
    # What E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY would say, as the SDK's options:
    # E2BExecutor passes its kwargs to Sandbox.create.
    return E2BExecutor(additional_imports, log.logger, api_url=gw.url, sandbox_url=gw.url,
                       api_key=gw.token)


def test_smolagents_e2b_executor_runs_a_multi_step_task(gw: Gateway):
    log = Log()
    ex = executor(gw, ["kgfix-app"], log)
    sandbox_id = ex.sandbox.sandbox_id
    try:
        # The executor's start installed its additional_imports with `!pip install`.
        assert "Successfully installed kgfix-app-2.0 kgfix-dep-0.3" in log.text(), log.text()
        out = ex("import kgfix_app\nkgfix_app.VALUE")
        assert (out.output, out.is_final_answer) == ("42", False)

        # Step 1: the data, and a variable sent by the framework.
        out = ex(
            "import pandas as pd\n"
            "sales = pd.DataFrame({'region': ['north', 'south', 'east', 'west'],\n"
            "                      'units': [12, 30, 7, 11]})\n"
            "print(f'{len(sales)} regions')"
        )
        assert out.logs == "4 regions\n"
        assert out.output is None
        ex.send_variables({"target": 50})

        # Step 2: uses what step 1 left in the kernel.
        out = ex(
            "total = int(sales['units'].sum())\n"
            "best = sales.loc[sales['units'].idxmax(), 'region']\n"
            "print(f'total {total}, best {best}, target met: {total >= target}')\n"
            "total"
        )
        assert out.logs == "total 60, best south, target met: True\n"
        assert out.output == "60"

        # Step 3: a chart, whose figure (the step's last expression) comes back as a PIL
        # image: the inline backend's PNG of the 400x300 figure, cropped to what is drawn.
        out = ex(
            "import matplotlib.pyplot as plt\n"
            "fig, ax = plt.subplots(figsize=(4, 3), dpi=100)\n"
            "ax.bar(sales['region'], sales['units'])\n"
            "ax.set_title('units by region')\n"
            "plt.close(fig)\n"
            "fig"
        )
        image = out.output
        assert type(image).__module__.startswith("PIL."), out
        assert image.format == "PNG"
        width, height = image.size
        assert 300 <= width <= 420 and 220 <= height <= 320, image.size

        # Step 4: an error is the framework's AgentError, naming the exception; the state
        # survives it.
        with pytest.raises(AgentError) as raised:
            ex("share = total / missing_count")
        assert "NameError" in raised.value.message
        assert "name 'missing_count' is not defined" in raised.value.message
        with pytest.raises(AgentError) as raised:
            ex("total / 0")
        assert "ZeroDivisionError" in raised.value.message
        assert "division by zero" in raised.value.message
        assert ex("total").output == "60"

        # Step 5: the final answer, through the framework's FinalAnswerTool.
        ex.send_tools({"final_answer": FinalAnswerTool()})
        out = ex("print('done')\nfinal_answer(f'{total} units, most in {best}')")
        assert out.is_final_answer is True
        assert out.output == "60 units, most in south"
        assert out.logs == "done\n"
    finally:
        ex.cleanup()
    # The sandbox, its kernel and container are gone.
    assert gw.request("GET", f"/api/kernels/{sandbox_id}").status_code == 404


def test_a_package_off_the_allowlist_is_refused(gw: Gateway):
    log = Log()
    # kgfix-denied is a good wheel, but the allowlist does not name it. `!pip install` is a
    # shell command: smolagents logs what it printed and goes on.
    ex = executor(gw, ["kgfix-denied"], log)
    try:
        assert (
            "ERROR: Package 'kgfix-denied' is not in this gateway's package allowlist"
            in log.text()
        ), log.text()
        assert "kgfix-app" in log.text()  # the refusal lists what may be installed
        with pytest.raises(AgentError) as raised:
            ex("import kgfix_denied")
        assert "ModuleNotFoundError" in raised.value.message
    finally:
        ex.cleanup()

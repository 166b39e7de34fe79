"""`kernelgate run` against Jupyter's own tools.

Every notebook in notebooks/ (plus a small one exercising stderr, display updates,
clear_output and an error) is executed twice: by `kernelgate run` through the real gateway
into the kernel container, and by nbclient on a local ipykernel of this venv (same
ipykernel, numpy, pandas and matplotlib versions as the kernel image). The gateway's file
must pass nbformat's validation, and both runs must show the same thing: per cell the same
execution count, the same kinds of outputs in the same order, the same text. Only what
legitimately differs between two machines is normalized: memory addresses, the temporary
file names ipykernel gives cells, and image bytes (for those: both decodable PNGs of the
same size).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from PIL import Image

from conftest import REPO, Gateway

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
BINARY = Path(os.environ.get("KERNELGATE_BIN", REPO / "target" / "debug" / "kernelgate"))

# Cells of the extra notebook: the output kinds the examples do not produce.
EDGE_CELLS = [
    "import sys, warnings\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n"
    "warnings.warn('careful')",
    "from IPython.display import display, HTML, Markdown, update_display\n"
    "display(HTML('<b>first</b>'), display_id='status')\n"
    "display(Markdown('*notes*'))\n"
    "update_display(HTML('<b>updated</b>'), display_id='status')",
    "from IPython.display import clear_output\nprint('gone')\nclear_output(wait=True)\n"
    "print('kept')",
    "for i in range(3):\n    print(i, end=' ', flush=True)\n{'answer': 42, 'items': [1, 2]}",
    "class Thing: pass\nThing()",
    "def f(x):\n    return 1 / x\nf(0)",
    "print('after the error')",
]

ADDRESS = re.compile(r"0x[0-9a-f]{6,16}")
CELL_FILE = re.compile(r"/tmp/ipykernel_\d+/\d+\.py")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def edge_notebook(path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in EDGE_CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def kernelgate_run(notebook: Path, out: Path, gateway: Gateway, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELGATE_")}
    return subprocess.run(
        [str(BINARY), "run", str(notebook), "-o", str(out), "--url", gateway.url, "--token", gateway.token, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def nbclient_run(notebook: Path, workdir: Path, monkeypatch, allow_errors: bool) -> nbformat.NotebookNode:
    # Only this venv's own ipykernel: no user-level or JUPYTER_PATH kernel spec may win.
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(workdir / "jupyter-data"))
    monkeypatch.delenv("JUPYTER_PATH", raising=False)
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=300,
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()
    return nb


def merged(outputs: list) -> list[dict]:
    """Consecutive stream outputs of one name as one (how they display, and how Jupyter saves
    them); nbclient by default keeps each stream message separate."""
    result: list[dict] = []
    for out in outputs:
        out = json.loads(json.dumps(out))
        if (
            out["output_type"] == "stream"
            and result
            and result[-1]["output_type"] == "stream"
            and result[-1]["name"] == out["name"]
        ):
            result[-1]["text"] += out["text"]
        else:
            result.append(out)
    return result


def norm(text: str) -> str:
    return CELL_FILE.sub("<cell>", ADDRESS.sub("0x…", ANSI.sub("", text)))


def png_size(b64: str) -> tuple[int, int]:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    image.load()  # decodes every pixel: a truncated or corrupt PNG fails here
    return image.size


def comparable(output: dict) -> dict:
    """One output, with only what may legitimately differ replaced."""
    kind = output["output_type"]
    if kind == "stream":
        return {"output_type": kind, "name": output["name"], "text": norm(output["text"])}
    if kind == "error":
        # Tracebacks name the kernel's temporary cell files; the last line is the error itself.
        last = norm(output["traceback"][-1]) if output["traceback"] else ""
        return {"output_type": kind, "ename": output["ename"], "evalue": norm(output["evalue"]), "last": last}
    data = {}
    for mime, value in output["data"].items():
        if mime.startswith("image/png"):
            data[mime] = ("png", png_size(value))
        elif isinstance(value, str):
            data[mime] = norm(value)
        else:
            data[mime] = value
    result = {"output_type": kind, "data": data, "metadata": output.get("metadata", {})}
    if kind == "execute_result":
        result["execution_count"] = output["execution_count"]
    return result


def assert_same_outputs(ours: nbformat.NotebookNode, reference: nbformat.NotebookNode) -> None:
    assert len(ours.cells) == len(reference.cells)
    for i, (a, b) in enumerate(zip(ours.cells, reference.cells)):
        assert a.cell_type == b.cell_type
        assert a.get("id") == b.get("id"), f"cell {i}: ids are kept"
        if a.cell_type != "code":
            assert a == b, f"cell {i}: non-code cells pass through unchanged"
            continue
        assert a.execution_count == b.execution_count, f"cell {i}"
        got = [comparable(o) for o in merged(a.outputs)]
        want = [comparable(o) for o in merged(b.outputs)]
        assert [o["output_type"] for o in got] == [o["output_type"] for o in want], f"cell {i}:\n{a.source}"
        for j, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"cell {i} output {j}:\n{a.source}"


def run_and_compare(notebook: Path, tmp_path: Path, gateway: Gateway, monkeypatch, allow_errors: bool):
    out = tmp_path / "kernelgate.ipynb"
    extra = ("--allow-errors",) if allow_errors else ()
    done = kernelgate_run(notebook, out, gateway, *extra)
    assert done.returncode == 0, done.stderr

    # What JupyterLab does on open: read, then validate against the nbformat 4 schema.
    raw = json.loads(out.read_text())
    nbformat.validate(raw)
    ours = nbformat.read(out, as_version=4)
    nbformat.validate(ours)
    assert ours.metadata["language_info"]["name"] == "python"

    workdir = tmp_path / "nbclient"
    workdir.mkdir()
    reference = nbclient_run(notebook, workdir, monkeypatch, allow_errors)
    assert_same_outputs(ours, reference)
    assert gateway.kernels() == [], "kernelgate run deletes its kernel"
    return ours


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_example_notebook_matches_nbclient(notebook: Path, tmp_path: Path, gateway: Gateway, monkeypatch):
    ours = run_and_compare(notebook, tmp_path, gateway, monkeypatch, allow_errors=False)
    kinds = {o.output_type for c in ours.cells if c.cell_type == "code" for o in c.outputs}
    assert "error" not in kinds
    assert kinds & {"execute_result", "display_data", "stream"}


def test_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {
        "monthly_sales.ipynb",
        "data_cleaning_report.ipynb",
        "statistics_figures.ipynb",
    }
    for p in NOTEBOOKS:
        nb = nbformat.read(p, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert len(code) >= 5, p.name
        assert all(c.outputs == [] and c.execution_count is None for c in code), f"{p.name} has outputs"


def test_streams_displays_and_errors_match_nbclient(tmp_path: Path, gateway: Gateway, monkeypatch):
    notebook = edge_notebook(tmp_path / "edge.ipynb")
    ours = run_and_compare(notebook, tmp_path, gateway, monkeypatch, allow_errors=True)
    cells = ours.cells
    assert [o.name for o in cells[0].outputs if o.output_type == "stream"] == ["stdout", "stderr"]
    assert "UserWarning: careful" in cells[0].outputs[1].text
    assert cells[1].outputs[0].data["text/html"] == "<b>updated</b>", "update_display_data applied"
    assert [o.text for o in cells[2].outputs] == ["kept\n"], "clear_output(wait=True) applied"
    assert cells[5].outputs[-1].ename == "ZeroDivisionError"
    assert cells[6].outputs[0].text == "after the error\n"

    # Without --allow-errors the same notebook fails at the error and says why.
    failed = kernelgate_run(notebook, tmp_path / "failed.ipynb", gateway)
    assert failed.returncode != 0
    assert "ZeroDivisionError: division by zero" in failed.stderr
    partial = nbformat.read(tmp_path / "failed.ipynb", as_version=4)
    nbformat.validate(partial)
    assert partial.cells[6].execution_count is None and partial.cells[6].outputs == []

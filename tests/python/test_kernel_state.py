"""The kernel image's state helper for hibernation, kernelgate_state
(kernel-image/kernelgate_state.py), in the real image under Docker's default runtime.

A variable saved by one container is loaded by a second, fresh one that gets the same home
(a host directory bind-mounted at /home/kernel, the way the gateway hands a hibernated
kernel's home to the kernel that replaces it). Most tests drive IPython's InteractiveShell
with plain `python -c` scripts; the last one runs the image's own launcher and sends the
gateway's silent execute requests with jupyter_client, so it proves the helper is
importable where the kernel looks (the launcher takes /opt/kernel off sys.path).

Environment: KERNELGATE_IMAGE, the kernel image (default kernelgate-kernel:latest).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import time
from pathlib import Path

import pytest

IMAGE = os.environ.get("KERNELGATE_IMAGE", "kernelgate-kernel:latest")
PYTHON = "/opt/kernel/venv/bin/python"
STATE = "/home/kernel/.kernelgate-state"
NOTICE = "Kernelgate: the kernel hibernated and these variables could not be kept: "
LOST = "Kernelgate: the kernel hibernated, but its saved state could not be loaded, so it starts afresh: "
# The sandbox the gateway gives a kernel, minus its limits; the home comes from the test.
SANDBOX = [
    "--network", "none", "--read-only", "--cap-drop", "ALL",
    "--security-opt", "no-new-privileges", "--tmpfs", "/tmp",
]

# What every script starts with: a shell like the kernel's, and `run` for one cell.
PRELUDE = '''
import contextlib, io, json, os, sys
import matplotlib
matplotlib.use("Agg")
from IPython.core.interactiveshell import InteractiveShell
import kernelgate_state

STATE = "/home/kernel/.kernelgate-state"
shell = InteractiveShell.instance()

def run(code):
    """Runs a cell as the kernel would; returns what it wrote on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = shell.run_cell(code, store_history=True)
    if not result.success:
        raise SystemExit(f"cell {code!r} failed: {result.error_before_exec or result.error_in_exec!r}")
    return err.getvalue()

def report(**values):
    print(json.dumps(values))
'''


def kernel_home(tmp_path: Path, name: str = "home") -> Path:
    """A host directory that serves as /home/kernel (uid 1000, mode 0700) in containers."""
    home = tmp_path / name
    home.mkdir()
    os.chown(home, 1000, 1000)
    home.chmod(0o700)
    return home


def in_image(home: Path, script: str) -> dict:
    """Runs PRELUDE + `script` in a fresh container with `home`; the JSON it reported last."""
    proc = subprocess.run(
        ["docker", "run", "--rm", *SANDBOX, "-v", f"{home}:/home/kernel", IMAGE, PYTHON, "-c",
         PRELUDE + script],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


SAVE = '''
for cell in [
    "import numpy as np",
    "n = 7; s = 'grüße'; d = {'a': [1, 2], 'b': (3, None)}",
    "a = np.random.default_rng(1).random(10 * 2**20 // 8)",
    "import pandas as pd\\ndf = pd.DataFrame({'k': [1, 2, 3], 'name': ['x', 'y', 'zz']})",
    "threshold = 2\\ndef f(v):\\n    return v * threshold",
    "class Point:\\n    def __init__(self, x):\\n        self.x = x\\n    def twice(self):\\n        return f(self.x)\\np = Point(5)",
    "sq = lambda v: v ** 2",
    "import matplotlib.pyplot as plt\\nfig, ax = plt.subplots()\\nline = ax.plot([1, 4, 9])",
    "__import__('os').environ['KG_TEST'] = 'yes'; del __import__('os').environ['LANG']",
    "__import__('os').makedirs('/home/kernel/work'); __import__('os').chdir('/home/kernel/work')",
]:
    run(cell)
kernelgate_state.save(STATE)
manifest = json.load(open(STATE + "/manifest.json"))
report(
    count=shell.execution_count,
    digest=__import__("hashlib").sha256(shell.user_ns["a"].tobytes()).hexdigest(),
    mode=oct(os.stat(STATE).st_mode & 0o777),
    files=sorted(os.listdir(STATE + "/vars")),
    variables=[v["name"] for v in manifest["variables"]],
    modules=manifest["modules"],
    dropped=manifest["dropped"],
    bytes=manifest["bytes"],
)
'''

LOAD = '''
before = set(shell.user_ns)
kernelgate_state.load(STATE)
restored = sorted(set(shell.user_ns) - before)
count = shell.execution_count
err = run("""
import hashlib
digest = hashlib.sha256(a.tobytes()).hexdigest()
same_df = df.equals(pd.DataFrame({'k': [1, 2, 3], 'name': ['x', 'y', 'zz']}))
f_before = f(3)
threshold = 10
f_after = f(3)
""")
ns = shell.user_ns
report(
    restored=restored, count=count, stderr=err, digest=ns["digest"], same_df=ns["same_df"],
    name_dtype=str(ns["df"]["name"].dtype), f_before=ns["f_before"], f_after=ns["f_after"],
    twice=ns["p"].twice(), is_point=isinstance(ns["p"], ns["Point"]), sq=ns["sq"](4),
    fig=type(ns["fig"]).__module__ + "." + type(ns["fig"]).__name__,
    ydata=[float(y) for y in ns["fig"].axes[0].lines[0].get_ydata()],
    In1=ns["In"][1], i1=ns["_i1"], np=ns["np"].__name__, n=ns["n"], s=ns["s"], d=repr(ns["d"]),
    cwd=os.getcwd(), KG_TEST=os.environ.get("KG_TEST"), LANG=os.environ.get("LANG"),
    state_left=os.path.exists(STATE),
)
'''


def test_a_saved_namespace_comes_back_in_a_fresh_process(tmp_path: Path) -> None:
    home = kernel_home(tmp_path)
    saved = in_image(home, SAVE)
    assert saved["mode"] == "0o700"
    assert saved["variables"] == ["n", "s", "d", "a", "df", "threshold", "f", "Point", "p", "sq",
                                  "fig", "ax", "line"]
    assert saved["files"] == sorted(f"{i}.pkl" for i in range(len(saved["variables"])))
    assert saved["modules"] == [
        {"name": "np", "module": "numpy"}, {"name": "pd", "module": "pandas"},
        {"name": "plt", "module": "matplotlib.pyplot"},
    ]
    assert saved["dropped"] == []
    assert 10 << 20 < saved["bytes"] < 11 << 20

    loaded = in_image(home, LOAD)
    assert loaded["count"] == saved["count"] == 11
    assert loaded["digest"] == saved["digest"]
    assert loaded["same_df"] is True
    assert loaded["name_dtype"] in ("str", "object", "string")
    assert (loaded["f_before"], loaded["f_after"]) == (6, 30)  # f sees the live namespace
    assert loaded["twice"] == 50 and loaded["is_point"] is True
    assert loaded["sq"] == 16
    assert loaded["fig"] == "matplotlib.figure.Figure"
    assert loaded["ydata"] == [1.0, 4.0, 9.0]
    assert loaded["In1"] == loaded["i1"] == "import numpy as np"
    assert loaded["np"] == "numpy"
    assert (loaded["n"], loaded["s"], loaded["d"]) == (7, "grüße", "{'a': [1, 2], 'b': (3, None)}")
    assert loaded["cwd"] == "/home/kernel/work"
    assert (loaded["KG_TEST"], loaded["LANG"]) == ("yes", None)
    assert loaded["stderr"] == ""
    assert loaded["state_left"] is False
    # Nothing but the restored names: the variables, the modules and IPython's input names.
    inputs = {f"_i{i}" for i in range(1, 11)} | {"_i", "_ii", "_iii"}
    assert set(loaded["restored"]) == set(saved["variables"]) | {"np", "pd", "plt"} | inputs


REFUSALS = '''
import threading
for cell in [
    "x = 1; big = __import__('numpy').zeros(3 * 2**20 // 8)",
    "def count():\\n    yield 1\\ngen = count()",
    "import sqlite3; conn = sqlite3.connect(':memory:')",
    "import threading, socket; lock = threading.Lock(); t = threading.Thread(target=print)",
    "fh = open('/tmp/f', 'w'); fh.write('buffered'); rf = open('/etc/hostname'); sock = socket.socket()",
]:
    run(cell)

def attempt(**kw):
    try:
        kernelgate_state.save(STATE, **kw)
        error = None
    except kernelgate_state.HibernateBlocked as e:
        error = str(e)
    return {"error": error, "state_left": os.path.exists(STATE)}

out = {
    "blocked": attempt(),
    "too_big_lossy": attempt(lossy=True, max_bytes=2**20),
    "both": attempt(max_bytes=2**20),
    "lossy": attempt(lossy=True),
}
manifest = json.load(open(STATE + "/manifest.json"))
out["saved"] = [v["name"] for v in manifest["variables"]]
out["dropped"] = manifest["dropped"]
# What the open file had buffered reached the file: nothing of it is lost with the handle.
out["flushed"] = open("/tmp/f").read()
report(**out)
'''

LOAD_LOSSY = '''
before = set(shell.user_ns)
kernelgate_state.load(STATE)
first = run("y = x + 1")
second = run("z = y + 1")
report(first=first, second=second, y=shell.user_ns["z"], gen="gen" in shell.user_ns,
       restored=sorted(set(shell.user_ns) - before))
'''

UNPICKLABLE = ("conn (sqlite3.Connection), fh (open file '/tmp/f' in mode 'w'), gen (generator), "
               "lock (_thread.lock), rf (open file '/etc/hostname' in mode 'r'), "
               "sock (socket.socket), t (threading.Thread)")


def test_what_cannot_be_pickled_blocks_the_save_unless_lossy(tmp_path: Path) -> None:
    home = kernel_home(tmp_path)
    out = in_image(home, REFUSALS)
    blocked = f"cannot be saved: {UNPICKLABLE}; delete them or hibernate with --hibernate-lossy"
    too_big = "the state would be 3 MiB, more than the 1 MiB allowed (--hibernate-max-mb)"
    assert out["blocked"] == {"error": blocked, "state_left": False}
    assert out["too_big_lossy"] == {"error": too_big, "state_left": False}
    assert out["both"] == {"error": f"{blocked}; {too_big}", "state_left": False}
    assert out["lossy"] == {"error": None, "state_left": True}
    assert out["saved"] == ["x", "big", "count"]
    assert [f"{d['name']} ({d['type']})" for d in out["dropped"]] == UNPICKLABLE.split(", ")
    # An open file is named, never turned into something else; what it buffered is written.
    assert out["flushed"] == "buffered"

    loaded = in_image(home, LOAD_LOSSY)
    # Once, in the output of the first cell after the wake.
    assert loaded["first"] == NOTICE + UNPICKLABLE + "\n"
    assert loaded["second"] == ""
    assert loaded["y"] == 3 and loaded["gen"] is False
    assert {"x", "big"} <= set(loaded["restored"]) and "gen" not in loaded["restored"]


CLOSED_AND_CORRUPT = '''
run("with open('/tmp/notes.txt', 'w') as f:\\n    f.write('a')")
kernelgate_state.save(STATE)
del shell.user_ns["f"]
kernelgate_state.load(STATE)
closed = shell.user_ns["f"].closed
os.makedirs(STATE)
with open(STATE + "/manifest.json", "w") as m:
    m.write("{not json")
try:
    kernelgate_state.load(STATE)
    error = None
except Exception as e:
    error = type(e).__name__
report(closed=closed, error=error, first=run("x = 1"), second=run("x = 2"))
'''


def test_a_closed_file_comes_back_closed_and_an_unreadable_state_says_so(tmp_path: Path) -> None:
    out = in_image(kernel_home(tmp_path), CLOSED_AND_CORRUPT)
    # What `with open(...) as f:` leaves behind does not block a hibernation.
    assert out["closed"] is True
    # A state that cannot be read fails the load, and the user hears it at the next cell.
    assert out["error"] == "JSONDecodeError"
    assert out["first"].startswith(LOST), out["first"]
    assert out["second"] == ""


# --- the kernel the gateway runs ---------------------------------------------------------------


def answered(client, msg_id: str) -> bool:
    """Whether a request got its reply and its idle status on IOPub. A reply alone can come
    before the SUB socket's subscription reaches the kernel, and what the next cell prints would
    then be dropped."""
    try:
        while client.get_shell_msg(timeout=2)["parent_header"].get("msg_id") != msg_id:
            pass
        while True:
            msg = client.get_iopub_msg(timeout=1)
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"):
                return True
    except queue.Empty:
        return False


def start_kernel(tmp_path: Path, home: Path, names: list[str]):
    """The image's own command (launch.py) in a container with `home`, and a jupyter_client
    client on its IPC sockets, as the gateway connects."""
    from jupyter_client import BlockingKernelClient

    run_dir = tmp_path / f"run-{len(names)}"
    run_dir.mkdir()
    os.chown(run_dir, 1000, 1000)
    run_dir.chmod(0o2770)
    info = {
        "transport": "ipc", "ip": "/run/kernel/kernel", "shell_port": 1, "iopub_port": 2,
        "stdin_port": 3, "control_port": 4, "hb_port": 5, "key": secrets.token_hex(32),
        "signature_scheme": "hmac-sha256", "kernel_name": "python3",
    }
    (run_dir / "kernel.json").write_text(json.dumps(info))
    os.chown(run_dir / "kernel.json", 1000, 1000)
    name = f"kg-state-test-{secrets.token_hex(4)}"
    names.append(name)
    subprocess.run(
        ["docker", "run", "-d", "--name", name, *SANDBOX, "-v", f"{home}:/home/kernel",
         "-v", f"{run_dir}:/run/kernel", IMAGE],
        check=True, capture_output=True, timeout=60,
    )
    client = BlockingKernelClient()
    client.load_connection_info({**info, "ip": str(run_dir / "kernel")})
    client.start_channels()
    # Ready once a kernel_info request is answered on both shell and IOPub. Not jupyter_client's
    # wait_for_ready: on a loaded machine it takes one late heartbeat (over 1 s) for a dead kernel.
    deadline = time.monotonic() + 60
    while True:
        if answered(client, client.kernel_info()):
            return client
        state = subprocess.run(
            ["docker", "inspect", "-f", "{{.State.Status}}", name],
            capture_output=True, text=True,
        ).stdout.strip()
        if state != "running" or time.monotonic() > deadline:
            logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True).stderr
            pytest.fail(f"the kernel did not answer (container {state}):\n{logs}")


def execute(client, code: str, silent: bool = False) -> tuple[dict, dict]:
    """The execute_reply's content and the stream text per stream name."""
    streams = {"stdout": "", "stderr": ""}

    def output(msg):
        if msg["msg_type"] == "stream":
            streams[msg["content"]["name"]] += msg["content"]["text"]

    reply = client.execute_interactive(
        code, silent=silent, store_history=not silent, output_hook=output, timeout=30
    )
    return reply["content"], streams


def test_the_gateway_requests_save_and_load_in_the_real_kernel(tmp_path: Path) -> None:
    home = kernel_home(tmp_path)
    names: list[str] = []
    save = "__import__('kernelgate_state').save({!r}, lossy={}, max_bytes={})"
    try:
        kernel = start_kernel(tmp_path, home, names)
        for cell in ["x = 41", "def f(v):\n    return v + x", "import math as m",
                     "def count():\n    yield 1\ngen = count()"]:
            reply, _ = execute(kernel, cell)
            assert reply["status"] == "ok", reply
        reply, _ = execute(kernel, save.format(STATE, False, 1 << 30), silent=True)
        assert (reply["status"], reply["ename"], reply["evalue"]) == (
            "error", "HibernateBlocked",
            "cannot be saved: gen (generator); delete them or hibernate with --hibernate-lossy",
        )
        reply, _ = execute(kernel, save.format(STATE, True, 1 << 30), silent=True)
        assert reply["status"] == "ok", reply
        kernel.stop_channels()
        subprocess.run(["docker", "rm", "-f", names[-1]], check=True, capture_output=True)
        assert (home / ".kernelgate-state" / "manifest.json").exists()

        started = time.monotonic()
        kernel = start_kernel(tmp_path, home, names)
        reply, streams = execute(kernel, f"__import__('kernelgate_state').load({STATE!r})", silent=True)
        assert reply["status"] == "ok", reply
        assert time.monotonic() - started < 20
        reply, streams = execute(kernel, "print(f(1), m.pi > 3, In[1], 'gen' in dir())")
        assert reply["status"] == "ok", reply
        assert reply["execution_count"] == 5  # four cells ran before the hibernation
        assert streams["stdout"] == "42 True x = 41 False\n"
        assert streams["stderr"] == NOTICE + "gen (generator)\n"
        reply, streams = execute(kernel, "x")
        assert streams["stderr"] == "" and reply["execution_count"] == 6
        assert not (home / ".kernelgate-state").exists()
        kernel.stop_channels()
    finally:
        for name in names:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True)

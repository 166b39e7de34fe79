"""Kernelgate kernel launcher: runs ipykernel on the connection file the gateway provides.

Usage (the image's CMD):

    /opt/kernel/venv/bin/python /opt/kernel/launch.py [CONNECTION_FILE]

CONNECTION_FILE defaults to /run/kernel/kernel.json. The gateway bind-mounts a per-kernel
directory at /run/kernel (setgid, mode 2770, group = the gateway's group) holding a connection
file with "transport": "ipc" and "ip": "/run/kernel/kernel"; ipykernel then binds the Unix
sockets /run/kernel/kernel-<port> for shell, iopub, stdin, control and heartbeat.

What this adds to a plain `python -m ipykernel_launcher -f FILE`:

* umask 0007 before any socket exists, so the sockets come out srwxrwx--- and the gateway,
  a member of the directory's group, can connect (zmq hides EACCES: the kernel would just
  look dead);
* XPUB_NODROP on the IOPub socket: when the reader falls behind, output waits instead of
  being dropped silently at libzmq's high-water mark (the reader must keep draining IOPub);
* HOME, IPYTHONDIR, MPLCONFIGDIR and JUPYTER_RUNTIME_DIR usable with a read-only root
  filesystem (defaults under /tmp, created when missing);
* the working directory: $HOME/work when it exists (the gateway may mount one), else $HOME;
* matplotlib's inline backend (plt.show() sends image/png) unless MPLBACKEND is set;
* KERNELGATE_PRELOAD=1 imports numpy, pandas and matplotlib.pyplot before serving, for warm
  pools.

SIGINT interrupts the running cell (tini -g forwards `docker kill -s INT` to this process).
"""

from __future__ import annotations

import os
import sys

DEFAULT_CONNECTION_FILE = "/run/kernel/kernel.json"
DEFAULT_HOME = "/home/kernel"
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
STATE_DIRS = (
    ("IPYTHONDIR", "/tmp/ipython"),
    ("MPLCONFIGDIR", "/tmp/matplotlib"),
    ("JUPYTER_RUNTIME_DIR", "/tmp/jupyter-runtime"),
)
PRELOAD_MODULES = ("numpy", "pandas", "matplotlib", "matplotlib.pyplot")


def _warn(message: str) -> None:
    print(f"kernelgate launcher: {message}", file=sys.stderr, flush=True)


def prepare_environment() -> None:
    """Umask, state directories, matplotlib backend and working directory."""
    # Before anything creates a socket or a file: group members (the gateway) may connect.
    os.umask(0o007)

    home = os.environ.get("HOME") or DEFAULT_HOME
    os.environ["HOME"] = home
    for var, default in STATE_DIRS:
        path = os.environ.get(var) or default
        os.environ[var] = path
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as err:
            _warn(f"cannot create {var}={path}: {err}")

    # ipykernel does the same when MPLBACKEND is unset; setting it here keeps the choice in
    # one visible place. MPLBACKEND=Agg would stop plt.show() from sending images.
    os.environ.setdefault("MPLBACKEND", INLINE_BACKEND)

    for candidate in (os.path.join(home, "work"), home, "/tmp"):
        if os.path.isdir(candidate):
            try:
                os.chdir(candidate)
                break
            except OSError as err:
                _warn(f"cannot chdir to {candidate}: {err}")
    if not os.access(os.getcwd(), os.W_OK):
        _warn(f"working directory {os.getcwd()} is not writable")


def make_app_class():
    """IPKernelApp whose IOPub socket never drops messages at the high-water mark."""
    import zmq
    from ipykernel.kernelapp import IPKernelApp

    class KernelgateKernelApp(IPKernelApp):
        def init_iopub(self, context: zmq.Context) -> None:
            # IPKernelApp.init_iopub creates the XPUB socket, binds it and hands it to the
            # IOPub thread, which starts using it at once; zmq sockets are not thread-safe, so
            # the option is set as a context default for the sockets created in this call
            # (pyzmq ignores options a socket type rejects, e.g. on the thread's PULL pipes).
            context.setsockopt(zmq.XPUB_NODROP, 1)
            try:
                super().init_iopub(context)
            finally:
                context.sockopts.pop(zmq.XPUB_NODROP, None)

    return KernelgateKernelApp


def preload() -> None:
    import importlib

    for name in PRELOAD_MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # a failed preload must not stop the kernel
            _warn(f"preload of {name} failed: {err!r}")


def main(argv: list[str]) -> int:
    if len(argv) > 2 or (len(argv) == 2 and argv[1].startswith("-")):
        _warn(f"usage: {argv[0]} [CONNECTION_FILE]  (default {DEFAULT_CONNECTION_FILE})")
        return 2
    connection_file = os.path.abspath(argv[1] if len(argv) == 2 else DEFAULT_CONNECTION_FILE)
    prepare_environment()
    if not os.access(connection_file, os.R_OK):
        # Without a readable file ipykernel would invent one with random ports nobody knows.
        _warn(f"connection file {connection_file} is missing or unreadable (uid {os.getuid()})")
        return 2

    # Like ipykernel_launcher: the script's own directory is not part of the user's path.
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]

    app = make_app_class().instance()
    app.initialize(["-f", connection_file])
    if os.environ.get("KERNELGATE_PRELOAD") == "1":
        # After initialize(): the shell exists, so pyplot's inline backend hooks into it.
        preload()
    app.start()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

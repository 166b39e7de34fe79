"""Kernelgate kernel launcher: runs ipykernel on the connection file the gateway provides.

Usage (the image's CMD):

    /opt/kernel/venv/bin/python /opt/kernel/launch.py [CONNECTION_FILE]

CONNECTION_FILE defaults to /run/kernel/kernel.json.

Exec mode, for commands the gateway runs in a kernel's sandbox or in a throwaway one
(`kernelgate packages sync`, shell commands):

    /opt/kernel/venv/bin/python /opt/kernel/launch.py [CONNECTION_FILE] --exec PROGRAM [ARG...]

installs the same syscall filter as for the kernel (below), then replaces itself with
PROGRAM (searched on PATH), so the command and everything it starts run under the filter.
The gateway appends `--exec PROGRAM ...` to the image's command; a CONNECTION_FILE before
it is ignored. Exit status 3 when the filter cannot be installed, 127 when PROGRAM cannot
be run. The gateway bind-mounts a per-kernel
directory at /run/kernel (setgid, mode 2770, group = the gateway's group) holding a connection
file with "transport": "ipc" and "ip": "/run/kernel/kernel"; ipykernel then binds the Unix
sockets /run/kernel/kernel-<port> for shell, iopub, stdin, control and heartbeat.

What this adds to a plain `python -m ipykernel_launcher -f FILE`:

* umask 0007 before any socket exists, so the sockets come out srwxrwx--- and the gateway,
  a member of the directory's group, can connect (zmq hides EACCES: the kernel would just
  look dead);
* XPUB_NODROP on the IOPub socket: when the reader falls behind, output waits instead of
  being dropped silently at libzmq's high-water mark (the reader must keep draining IOPub);
* output back-pressure: a thread that prints or displays faster than IOPub can send waits
  (interruptibly) once the IOPub thread holds OUTPUT_BACKLOG_BYTES unsent, and a stream
  flushes itself past OUTPUT_CHUNK_CHARS, so a runaway print loop costs the kernel a bounded
  amount of memory instead of growing ipykernel's queues until it is OOM-killed; and IPython's
  copy of every printed string in its output history (used by `%notebook`), which grows
  without bound under a print loop, is not kept;
* HOME, IPYTHONDIR, MPLCONFIGDIR and JUPYTER_RUNTIME_DIR usable with a read-only root
  filesystem (defaults under /tmp, created when missing);
* the working directory: $HOME/work when it exists (the gateway may mount one), else $HOME;
* matplotlib's inline backend (plt.show() sends image/png) unless MPLBACKEND is set;
* KERNELGATE_PRELOAD=1 imports numpy, pandas and matplotlib.pyplot before serving, for warm
  pools;
* a seccomp filter of its own, stacked on the container runtime's: syscalls a data analysis
  never needs and attackers love (ptrace, process_vm_readv/writev, userfaultfd, io_uring,
  keyctl/add_key/request_key, bpf, perf_event_open, personality beyond the usual values, the
  x32 ABI) fail with EPERM for the kernel and everything it starts. Filters only ever add
  up, so the runtime's profile (Docker's default under runc) still applies underneath, and
  under gVisor, which enforces seccomp filters of sandboxed processes itself, this one holds
  too. If it cannot be installed the kernel does not start.

Relay mode (KERNELGATE_RELAY=1, set by the gVisor engine for images labelled
org.kernelgate.relay=1), so that a whole kernel can be checkpointed and restored: a sandbox
that holds a bound host Unix socket cannot be saved. ipykernel then binds its five sockets on
the sandbox's own tmpfs (RELAY_DIR) and in-process relay threads (zmq.proxy_steerable: C code
that runs without the GIL) bridge them to the host-visible sockets of CONNECTION_FILE.
SIGUSR1 makes the relays close every host socket (the sockets' files go with them); SIGUSR2
re-reads CONNECTION_FILE and binds the host sockets again; after a restore the file holds a
new HMAC key (perhaps new ports), and the kernel takes it with a new session id and reseeds
`random` and `numpy.random`; an unchanged key (a snapshot taken of a running kernel) changes
nothing. The pid the
signals go to is written to RELAY_PID_FILE beside the connection file. ipykernel's pipe for
the output of forked children is moved from tcp://127.0.0.1 to an ipc socket there too (a
listening TCP socket cannot be saved either).

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
# Output the IOPub thread may hold before producers wait, and the stream text a print loop may
# buffer before it flushes (and waits) itself; with IOPUB_SNDHWM messages queued in libzmq.
OUTPUT_BACKLOG_BYTES = 8 << 20
OUTPUT_CHUNK_CHARS = 1 << 20
IOPUB_SNDHWM = 32

# The syscalls the filter refuses, by architecture (numbers from the kernel's syscall tables).
DENIED_SYSCALLS = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "userfaultfd": 323,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "add_key": 248, "request_key": 249, "keyctl": 250, "bpf": 321, "perf_event_open": 298,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "userfaultfd": 282,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "add_key": 217, "request_key": 218, "keyctl": 219, "bpf": 280, "perf_event_open": 241,
    },
}
PERSONALITY = {"x86_64": 135, "aarch64": 92}
# personality(2) values Docker's default profile allows: PER_LINUX, PER_LINUX32,
# UNAME26, UNAME26|PER_LINUX32, and 0xffffffff (query).
PERSONALITY_ALLOWED = (0x0, 0x0008, 0x20000, 0x20008, 0xFFFFFFFF)
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000


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


def syscall_filter(machine: str) -> list[tuple[int, int, int, int]]:
    """The classic-BPF program of the filter, as (code, jt, jf, k) instructions."""
    ld_w_abs, jeq_k, jge_k, ret_k = 0x20, 0x15, 0x35, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    nr_at, arch_at, arg0_at = 0, 4, 16
    denied = sorted(DENIED_SYSCALLS[machine].values())
    prog = [
        (ld_w_abs, 0, 0, arch_at),
        (jeq_k, 1, 0, AUDIT_ARCH[machine]),
        (ret_k, 0, 0, eperm),  # another ABI (i386): its numbers differ, so none at all
        (ld_w_abs, 0, 0, nr_at),
    ]
    if machine == "x86_64":
        prog += [(jge_k, 0, 1, X32_SYSCALL_BIT), (ret_k, 0, 0, eperm)]
    for nr in denied:
        prog += [(jeq_k, 0, 1, nr), (ret_k, 0, 0, eperm)]
    allowed = PERSONALITY_ALLOWED
    prog += [(jeq_k, 0, len(allowed) + 2, PERSONALITY[machine]), (ld_w_abs, 0, 0, arg0_at)]
    for i, value in enumerate(allowed):
        prog.append((jeq_k, len(allowed) - i, 0, value))
    prog += [(ret_k, 0, 0, eperm), (ret_k, 0, 0, allow)]
    return prog


def install_syscall_filter() -> None:
    """Installs the filter on this process (and so on everything it starts)."""
    import ctypes
    import platform

    machine = platform.machine()
    if machine not in DENIED_SYSCALLS:
        raise OSError(f"no syscall filter for {machine}")

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte),
                    ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    prog = syscall_filter(machine)
    insns = (SockFilter * len(prog))(*(SockFilter(*i) for i in prog))
    fprog = SockFprog(len(prog), insns)
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def _nbytes(part) -> int:
    try:
        return memoryview(part).nbytes
    except TypeError:
        return len(part) if hasattr(part, "__len__") else 0


def bound_output_backlog() -> None:
    """Makes producers of IOPub messages wait while the IOPub thread is behind.

    ipykernel queues every message for its IOPub thread without bound, and a stream buffers
    text until its next timed flush: a loop printing faster than the gateway reads grows
    both until the kernel runs out of memory. Here every send is counted until the IOPub
    thread has handed it to libzmq (which blocks at its high-water mark, XPUB_NODROP), and a
    thread other than the IOPub thread waits while more than OUTPUT_BACKLOG_BYTES are unsent.
    The wait is a Condition wait with a timeout: SIGINT (interrupt) still ends the cell.
    """
    import threading

    from ipykernel import iostream

    thread_class, stream_class = iostream.IOPubThread, iostream.OutStream
    send_multipart, write = thread_class.send_multipart, stream_class.write

    def backlog(io):
        found = io.__dict__.get("_kernelgate_backlog")
        if found is None:
            found = io.__dict__.setdefault("_kernelgate_backlog", [threading.Condition(), 0])
        return found

    def wait_for_room(io) -> None:
        if not io.thread.is_alive() or threading.current_thread() is io.thread:
            return
        cond = backlog(io)
        with cond[0]:
            while cond[1] > OUTPUT_BACKLOG_BYTES and io.thread.is_alive() and not io.closed:
                cond[0].wait(0.25)

    def bounded_send_multipart(self, msg, *args, **kwargs):
        size = sum(_nbytes(part) for part in msg)
        cond = backlog(self)
        with cond[0]:
            cond[1] += size

        def send():
            try:
                self._really_send(msg, *args, **kwargs)
            finally:
                with cond[0]:
                    cond[1] -= size
                    cond[0].notify_all()

        self.schedule(send)
        wait_for_room(self)

    def bounded_write(self, string):
        written = write(self, string)
        io = self.pub_thread
        if (
            io is None
            or not io.thread.is_alive()
            or threading.current_thread() is io.thread
            or not self._is_master_process()
        ):
            return written
        with self._buffer_lock:
            buffered = sum(b.tell() for b in self._buffers.values())
        if buffered > OUTPUT_CHUNK_CHARS:
            flushed = threading.Event()
            io.schedule(self._flush)
            io.schedule(flushed.set)
            while not flushed.wait(0.25) and io.thread.is_alive():
                pass
            wait_for_room(io)
        return written

    # IPython 9 tees every write to stdout/stderr into history_manager.outputs for the rest
    # of the session: a print loop keeps every string it printed. The tee is left out.
    from contextlib import contextmanager

    from IPython.core.interactiveshell import InteractiveShell

    if hasattr(InteractiveShell, "_tee"):

        @contextmanager
        def no_tee(self, channel):
            yield

        InteractiveShell._tee = no_tee

    bounded_send_multipart.__wrapped__ = send_multipart
    bounded_write.__wrapped__ = write
    thread_class.send_multipart = bounded_send_multipart
    stream_class.write = bounded_write


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
            context.setsockopt(zmq.SNDHWM, IOPUB_SNDHWM)
            try:
                super().init_iopub(context)
            finally:
                context.sockopts.pop(zmq.XPUB_NODROP, None)
                context.sockopts.pop(zmq.SNDHWM, None)

    return KernelgateKernelApp


def preload() -> None:
    import importlib

    for name in PRELOAD_MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # a failed preload must not stop the kernel
            _warn(f"preload of {name} failed: {err!r}")


RELAY_ENV = "KERNELGATE_RELAY"
RELAY_DIR = "/tmp/.kernelgate-relay"
RELAY_PID_FILE = "relay.pid"
# The identity of the relays' DEALER sockets towards the kernel: one for shell, control and
# stdin alike, so that an input_request on stdin finds its way to the client that asked.
RELAY_IDENTITY = b"kernelgate-relay"
CHANNELS = ("shell", "control", "stdin", "hb", "iopub")
# How long the relays may take to close their host sockets when asked to.
QUIESCE_SECONDS = 5.0


class Relays:
    """One thread per channel bridging the kernel's socket on the sandbox's tmpfs to the
    host-visible one named by the connection file: quiesced (host sockets closed) and
    served again on SIGUSR1 and SIGUSR2."""

    def __init__(self, host_file: str) -> None:
        import threading

        import zmq

        self.host_file = host_file
        self.host = self._read(host_file)
        self.inner_ip = os.path.join(RELAY_DIR, "k")
        self.ctx = zmq.Context(io_threads=1)
        self.go = {name: threading.Event() for name in CHANNELS}
        self.quiet = {name: threading.Event() for name in CHANNELS}
        self.controls = {}
        self.serving = False

    @staticmethod
    def _read(path: str) -> dict:
        import json

        with open(path) as f:
            return json.load(f)

    def inner_file(self) -> str:
        """The connection file ipykernel binds by: the host's ports and key, on RELAY_DIR."""
        import json

        os.makedirs(RELAY_DIR, mode=0o700, exist_ok=True)
        inner = dict(self.host, transport="ipc", ip=self.inner_ip)
        path = os.path.join(RELAY_DIR, "kernel.json")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(inner, f)
        return path

    def _address(self, conn: dict, ip: str, name: str) -> str:
        return f"ipc://{ip}-{conn[name + '_port']}"

    def _channel(self, name: str) -> None:
        import zmq

        backend_type = zmq.XSUB if name == "iopub" else zmq.DEALER
        frontend_type = zmq.XPUB if name == "iopub" else zmq.ROUTER
        backend = self.ctx.socket(backend_type)
        backend.linger = 0
        if name == "iopub":
            backend.rcvhwm = IOPUB_SNDHWM
        else:
            backend.identity = RELAY_IDENTITY
        backend.connect(self._address(self.host, self.inner_ip, name))
        control = self.ctx.socket(zmq.PAIR)
        control.bind(f"inproc://kernelgate-relay-{name}")
        while True:
            self.go[name].wait()
            self.go[name].clear()
            frontend = self.front_ctx.socket(frontend_type)
            frontend.linger = 0
            if name == "iopub":
                frontend.setsockopt(zmq.XPUB_NODROP, 1)
                frontend.sndhwm = IOPUB_SNDHWM
            else:
                frontend.setsockopt(zmq.ROUTER_HANDOVER, 1)
            try:
                frontend.bind(self._address(self.host, self.host["ip"], name))
                zmq.proxy_steerable(frontend, backend, None, control)
            except zmq.ZMQError as err:
                _warn(f"the {name} relay stopped: {err}")
            finally:
                frontend.close(linger=0)
                self.quiet[name].set()

    def start(self) -> None:
        """Starts the channel threads and the control thread, which serves at once, then
        quiesces on each SIGUSR1 and serves again on each SIGUSR2. The signals reach it
        through Python's wakeup fd, which the C-level handler writes on whichever thread the
        signal lands: a Python-level handler would wait for the main thread's next bytecode,
        which an idle kernel's event loop may not run for a long time."""
        import signal
        import threading

        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, lambda *_: None)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        for name in CHANNELS:
            threading.Thread(
                target=self._channel, args=(name,), name=f"kernelgate-relay-{name}", daemon=True
            ).start()
        threading.Thread(
            target=self._control, args=(wake_r,), name="kernelgate-relay-signals", daemon=True
        ).start()

    def _control(self, wake_r: int) -> None:
        import signal

        import zmq

        for name in CHANNELS:
            # The channel thread binds its end; inproc connects to a later bind too.
            control = self.ctx.socket(zmq.PAIR)
            control.connect(f"inproc://kernelgate-relay-{name}")
            self.controls[name] = control
        self.serve()
        while True:
            for signum in os.read(wake_r, 64):
                if signum == signal.SIGUSR1:
                    self.quiesce()
                elif signum == signal.SIGUSR2:
                    self.resume()

    def serve(self) -> None:
        import zmq

        # The host sockets get a context of their own: terminating it is what waits until
        # libzmq has really closed them (a close alone finishes later, in its I/O thread).
        self.front_ctx = zmq.Context(io_threads=1)
        for name in CHANNELS:
            self.quiet[name].clear()
            self.go[name].set()
        self.serving = True
        self.write_pid()

    def write_pid(self) -> None:
        path = os.path.join(os.path.dirname(self.host_file), RELAY_PID_FILE)
        try:
            with open(path + ".tmp", "w") as f:
                f.write(f"{os.getpid()}\n")
            os.replace(path + ".tmp", path)
        except OSError as err:
            _warn(f"cannot write {path}: {err}")

    def quiesce(self) -> None:
        """Closes every host socket (SIGUSR1): nothing of the sandbox is bound outside."""
        if not self.serving:
            return
        self.serving = False
        for name in CHANNELS:
            self.controls[name].send(b"TERMINATE")
        stuck = [name for name in CHANNELS if not self.quiet[name].wait(QUIESCE_SECONDS)]
        if stuck:
            # The host sockets stay: the gateway finds their files and does not checkpoint.
            _warn(f"the {', '.join(stuck)} relays did not stop within {QUIESCE_SECONDS} s")
            return
        self.front_ctx.term()
        # Their files are what tells the gateway that nothing is bound outside any more
        # (libzmq leaves an ipc socket's file behind).
        for name in CHANNELS:
            path = f"{self.host['ip']}-{self.host[name + '_port']}"
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as err:
                _warn(f"cannot remove {path}: {err}")

    def resume(self) -> None:
        """Reads the connection file again and serves on it (SIGUSR2): after a restore the
        gateway wrote a new key and session there. The same key means the same kernel goes
        on (a snapshot was taken of it): its session and random state stay as they were."""
        if self.serving:
            return
        try:
            host = self._read(self.host_file)
        except (OSError, ValueError) as err:
            _warn(f"cannot read {self.host_file}, the relays stay closed: {err}")
            return
        if host.get("key") != self.host.get("key"):
            rekey(host)
        # The relays' connections to the kernel stay; their host sockets take the new names.
        self.host = host
        self.serve()


def rekey(host: dict) -> None:
    """The kernel's session takes the connection file's key and a new session id; the
    module-level random generators are reseeded (a restored copy must not repeat the
    numbers of its image, nor of its sibling copies)."""
    import random
    import uuid

    from ipykernel.kernelapp import IPKernelApp

    if IPKernelApp.initialized():
        session = IPKernelApp.instance().session
        session.key = host["key"].encode()
        session.session = str(uuid.uuid4())
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def ipc_fork_pipe() -> None:
    """ipykernel's pipe for output of forked children, on an ipc socket in RELAY_DIR
    instead of a listening TCP socket on 127.0.0.1."""
    import warnings

    import zmq
    from ipykernel import iostream
    from zmq.eventloop.zmqstream import ZMQStream

    address = f"ipc://{RELAY_DIR}/fork-pipe"

    def setup_pipe_in(self):
        self._pipe_uuid = os.urandom(16)
        pipe_in = self.socket.context.socket(zmq.PULL)
        pipe_in.linger = 0
        try:
            pipe_in.bind(address)
        except zmq.ZMQError as err:
            warnings.warn(f"cannot bind the IOPub pipe at {address}: {err}", stacklevel=2)
            self._pipe_flag = False
            pipe_in.close()
            return
        self._pipe_in = ZMQStream(pipe_in, self.io_loop)
        self._pipe_in.on_recv(self._handle_pipe_msg)

    def setup_pipe_out(self):
        ctx = zmq.Context()
        pipe_out = ctx.socket(zmq.PUSH)
        pipe_out.linger = 3000
        pipe_out.connect(address)
        return ctx, pipe_out

    iostream.IOPubThread._setup_pipe_in = setup_pipe_in
    iostream.IOPubThread._setup_pipe_out = setup_pipe_out


EXEC_FLAG = "--exec"


def exec_filtered(command: list[str]) -> int:
    """Installs the syscall filter, then runs `command` in this process's place."""
    if not command:
        _warn(f"usage: launch.py [CONNECTION_FILE] {EXEC_FLAG} PROGRAM [ARG...]")
        return 2
    try:
        install_syscall_filter()
    except OSError as err:
        _warn(f"cannot install the syscall filter, refusing to run {command[0]}: {err}")
        return 3
    try:
        os.execvp(command[0], command)
    except OSError as err:
        _warn(f"cannot run {command[0]}: {err}")
    return 127


def main(argv: list[str]) -> int:
    if EXEC_FLAG in argv[1:]:
        return exec_filtered(argv[argv.index(EXEC_FLAG, 1) + 1:])
    if len(argv) > 2 or (len(argv) == 2 and argv[1].startswith("-")):
        _warn(f"usage: {argv[0]} [CONNECTION_FILE]  (default {DEFAULT_CONNECTION_FILE})")
        return 2
    connection_file = os.path.abspath(argv[1] if len(argv) == 2 else DEFAULT_CONNECTION_FILE)
    try:
        install_syscall_filter()
    except OSError as err:
        _warn(f"cannot install the syscall filter, refusing to start: {err}")
        return 3
    prepare_environment()
    if not os.access(connection_file, os.R_OK):
        # Without a readable file ipykernel would invent one with random ports nobody knows.
        _warn(f"connection file {connection_file} is missing or unreadable (uid {os.getuid()})")
        return 2

    # Like ipykernel_launcher: the script's own directory is not part of the user's path.
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]

    bound_output_backlog()
    relays = None
    if os.environ.get(RELAY_ENV) == "1":
        relays = Relays(connection_file)
        ipc_fork_pipe()
        connection_file = relays.inner_file()
    app = make_app_class().instance()
    app.initialize(["-f", connection_file])
    if relays is not None:
        # After initialize(): the kernel's sockets are bound for the relays to reach.
        relays.start()
    if os.environ.get("KERNELGATE_PRELOAD") == "1":
        # After initialize(): the shell exists, so pyplot's inline backend hooks into it.
        preload()
    app.start()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
